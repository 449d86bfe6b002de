"""The exact paired test of `podsrl compare`: sign-flip p-values on hand-worked cases, its false-positive rate by
simulation, Holm's correction, chi-square quantiles, the interval's real level and the verdict's words."""

from __future__ import annotations

import math

import numpy as np
import pytest

from podsrl.experiments.paired_test import (
    EXACT_MAX,
    MEASURED_COVERAGE,
    NOMINAL_FROM,
    RANGE_UP_TO,
    chi2_quantile,
    holm,
    interval_label,
    range_coverage,
    sd_interval,
    sign_flip_p,
    verdict_text,
)
from podsrl.experiments.stats import BETTER, bootstrap_interval, paired_stat


def test_sign_flip_p_hand_worked():
    # all three positive: only the observed pattern reaches its sum, 1 of 8; two-sided 2 of 8
    assert sign_flip_p([1.0, 2.0, 3.0]) == 0.125
    assert sign_flip_p([1.0, 2.0, 3.0], "two-sided") == 0.25
    assert sign_flip_p([1.0, 2.0, 3.0], "less") == 1.0
    # d = (3, -1, 2), sum 4; the 8 sums of +-3 +-1 +-2 are 6, 4, 2, 0, 0, -2, -4, -6
    assert sign_flip_p([3.0, -1.0, 2.0]) == 2 / 8
    assert sign_flip_p([3.0, -1.0, 2.0], "less") == 7 / 8
    assert sign_flip_p([3.0, -1.0, 2.0], "two-sided") == 4 / 8
    # ties count: (1, 1, -1, 1), sum 2; sums >= 2 are the one 4 and the four 2s of 16 patterns
    assert sign_flip_p([1.0, 1.0, -1.0, 1.0]) == 5 / 16
    # every seed agreeing: 2^-n, 0.031 at n = 5
    assert sign_flip_p([0.1, 0.2, 0.1, 0.3, 0.05]) == 1 / 32
    with pytest.raises(ValueError):
        sign_flip_p([])
    with pytest.raises(ValueError):
        sign_flip_p([1.0], "bigger")


def test_sign_flip_p_sampled_beyond_exact_max_agrees_with_enumeration():
    n = EXACT_MAX + 1
    d = np.random.default_rng(3).normal(0.4, 1.0, n)
    signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    exact = float(((signs @ d) >= d.sum() - 1e-9).mean())
    assert sign_flip_p(d) == pytest.approx(exact, abs=0.005)
    assert sign_flip_p(d) == sign_flip_p(d)  # seeded: the same runs give the same report
    # all positive: p is (1 + hits) / (1 + samples), never 0
    assert 0 < sign_flip_p(np.ones(n)) < 3e-5


@pytest.mark.parametrize("n", [3, 5, 10])
def test_false_positive_rate_at_most_alpha(n):
    """No effect (symmetric differences, normal and heavy-tailed): a one-sided p <= 0.05 at most 5% of the time."""
    rng = np.random.default_rng(n)
    trials = 1000
    for draw in (lambda: rng.normal(0.0, 1.0, n), lambda: rng.standard_t(2, n)):
        rate = np.mean([sign_flip_p(draw()) <= 0.05 for _ in range(trials)])
        assert rate <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials), (n, rate)
        if n == 3:
            assert rate == 0  # no result of 3 pairs reaches 5%: the smallest p is 1/8
        if n == 5:
            assert rate == pytest.approx(1 / 32, abs=0.02)  # only "all five agree" gets there
    # the verdict itself (one metric, the report's own code): "better" under no effect at most alpha
    verdicts = [paired_stat("x", dict(enumerate(np.zeros(n))), dict(enumerate(rng.normal(0, 1, n)))).verdict
                for _ in range(100)]
    assert verdicts.count(BETTER) / 100 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 100)


def test_holm_hand_worked():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> step-down keeps 0.06 for the last
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.01, None, 0.04]) == [pytest.approx(0.02), None, pytest.approx(0.04)]
    assert holm([0.6, 0.7]) == [1.0, 1.0]
    assert holm([0.125] * 5) == [0.625] * 5


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [(0.975, 2, 7.377759), (0.025, 2, 0.050636), (0.975, 9, 19.022768), (0.025, 9, 2.700389), (0.5, 1, 0.454936)],
)
def test_chi2_quantile_matches_tables(p, df, expected):
    assert chi2_quantile(p, df) == pytest.approx(expected, rel=1e-5)


def test_sd_interval_hand_values():
    low, high = sd_interval(1.0, 10, 0.05)
    assert (low, high) == (pytest.approx(math.sqrt(9 / 19.022768)), pytest.approx(math.sqrt(9 / 2.700389)))
    low, high = sd_interval(2.0, 3, 0.05)  # 3 seeds: the true spread may be half or six times what was seen
    assert low == pytest.approx(2 * 0.5207, rel=1e-3) and high == pytest.approx(2 * 6.285, rel=1e-3)


def test_interval_labels_name_the_real_level():
    assert range_coverage(3) == 0.75 and range_coverage(4) == 0.875
    assert interval_label(3, 0.05) == "n = 3: range, ~75% for the median"
    assert interval_label(4, 0.05) == "n = 4: range, ~88% for the median"
    assert "95%" not in "".join(interval_label(n, 0.05) for n in range(2, NOMINAL_FROM))
    assert interval_label(NOMINAL_FROM, 0.05) == f"n = {NOMINAL_FROM}: bootstrap 95%"
    # up to RANGE_UP_TO the expanded bootstrap really is the range; one seed more, it is not
    rng = np.random.default_rng(0)
    for n in (2, 3, RANGE_UP_TO):
        d = rng.normal(0, 1, n)
        assert np.allclose(bootstrap_interval(d), (d.min(), d.max()), rtol=1e-12)
    d = rng.normal(0, 1, RANGE_UP_TO + 1)
    assert not np.allclose(bootstrap_interval(d), (d.min(), d.max()), rtol=1e-12)


@pytest.mark.parametrize("n", sorted(MEASURED_COVERAGE))
def test_measured_coverage_holds(n):
    """The quoted level between the range and the nominal one, re-measured (fewer draws than the script)."""
    rng = np.random.default_rng(11)
    trials = 600
    hits = 0
    for t in range(trials):
        lo, hi = bootstrap_interval(rng.normal(0.3, 1.0, n), resamples=2000, seed=t)
        hits += lo <= 0.3 <= hi
    assert hits / trials == pytest.approx(MEASURED_COVERAGE[n], abs=4 * math.sqrt(0.08 / trials))


def test_verdict_words():
    assert verdict_text("better", 5, 5, 1 / 32, 1 / 32, 0.05) == "better (5 of 5 seeds, p = 0.031)"
    assert verdict_text("worse", 7, 8, 0.0078, 0.02, 0.05) == "worse (7 of 8 seeds, p = 0.008, Holm 0.020)"
    assert verdict_text("better", 3, 3, 0.125, 0.125, 0.05) == (
        "all 3 seeds agree, better (p = 0.125: not significant at 5%)"
    )
    assert verdict_text("better", 5, 5, 1 / 32, 5 / 32, 0.05) == (
        "all 5 seeds agree, better (p = 0.031, Holm 0.156: not significant at 5%)"
    )
    assert verdict_text("worse", 2, 2, 0.25, 0.25, 0.05) == "both seeds agree, worse (p = 0.250: not significant at 5%)"
    assert verdict_text("better", 2, 3, 0.375, 0.375, 0.05) == "inconclusive"
    assert verdict_text("better", 1, 1, None, None, 0.05) == "inconclusive"
    assert verdict_text("better", 12, 12, 0.0002, 0.0002, 0.05) == "better (12 of 12 seeds, p < 0.001)"
