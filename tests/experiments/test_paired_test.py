"""The exact paired test of `podsrl compare`: sign-flip p-values on hand-worked cases, the verdict's false-positive
rate and power by simulation, Holm's correction, chi-square quantiles, the interval's real level and the verdict's
words."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from podsrl.experiments.paired_test import (
    EXACT_MAX,
    MEASURED_COVERAGE,
    NOMINAL_FROM,
    RANGE_UP_TO,
    alternative_for,
    chi2_quantile,
    fewest_seeds,
    holm,
    interval_label,
    range_coverage,
    sd_interval,
    sign_flip_p,
    verdict_side,
    verdict_text,
)
from podsrl.experiments.stats import (
    ALPHA,
    BETTER,
    INCONCLUSIVE,
    WORSE,
    bootstrap_interval,
    paired_family,
    paired_stat,
)

TRIALS = 4000
BOUND = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / TRIALS)  # alpha + 3 standard errors of a rate over TRIALS
NO_EFFECT = {  # symmetric differences centred on 0: normal and heavy-tailed
    "normal": lambda rng, size: rng.normal(0.0, 1.0, size),
    "t2": lambda rng, size: rng.standard_t(2, size),
    "cauchy": lambda rng, size: rng.standard_cauchy(size),
}


def verdicts(diffs: np.ndarray, expect: str | None = None) -> np.ndarray:
    """The report's verdict on one metric for each row of differences: +1 better, -1 worse, 0 inconclusive."""
    return verdict_side(diffs.mean(axis=1), sign_flip_p(diffs, alternative_for(expect)), ALPHA, expect=expect)


def test_sign_flip_p_hand_worked():
    # all three positive: only the observed pattern reaches its sum, 1 of 8; two-sided (the default) 2 of 8
    assert sign_flip_p([1.0, 2.0, 3.0], "greater") == 0.125
    assert sign_flip_p([1.0, 2.0, 3.0]) == 0.25
    assert sign_flip_p([1.0, 2.0, 3.0], "less") == 1.0
    # d = (3, -1, 2), sum 4; the 8 sums of +-3 +-1 +-2 are 6, 4, 2, 0, 0, -2, -4, -6
    assert sign_flip_p([3.0, -1.0, 2.0], "greater") == 2 / 8
    assert sign_flip_p([3.0, -1.0, 2.0], "less") == 7 / 8
    assert sign_flip_p([3.0, -1.0, 2.0]) == 4 / 8
    # ties count: (1, 1, -1, 1), sum 2; sums >= 2 are the one 4 and the four 2s of 16 patterns, |sums| >= 2: 10
    assert sign_flip_p([1.0, 1.0, -1.0, 1.0], "greater") == 5 / 16
    assert sign_flip_p([1.0, 1.0, -1.0, 1.0]) == 10 / 16
    # every seed agreeing: one-sided 2^-n, two-sided twice that: 0.0625 at n = 5, 0.031 at n = 6
    assert sign_flip_p([0.1, 0.2, 0.1, 0.3, 0.05], "greater") == 1 / 32
    assert sign_flip_p([0.1, 0.2, 0.1, 0.3, 0.05]) == 1 / 16
    assert sign_flip_p([0.1, 0.2, 0.1, 0.3, 0.05, 0.2]) == 1 / 32
    # rows are comparisons: the same p as one at a time
    rows = np.random.default_rng(0).normal(0.2, 1.0, (50, 7))
    assert sign_flip_p(rows).tolist() == [sign_flip_p(r) for r in rows]
    with pytest.raises(ValueError):
        sign_flip_p([])
    with pytest.raises(ValueError):
        sign_flip_p([1.0], "bigger")


def test_sign_flip_p_sampled_beyond_exact_max_agrees_with_enumeration():
    n = EXACT_MAX + 1
    d = np.random.default_rng(3).normal(0.4, 1.0, n)
    signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    exact = float((np.abs(signs @ d) >= abs(d.sum()) - 1e-9).mean())
    assert sign_flip_p(d) == pytest.approx(exact, abs=0.005)
    assert sign_flip_p(d) == sign_flip_p(d)  # seeded: the same runs give the same report
    assert sign_flip_p(np.stack([d, -d])).tolist() == [sign_flip_p(d)] * 2
    # all positive: p is (1 + hits) / (1 + samples), never 0
    assert 0 < sign_flip_p(np.ones(n), "greater") < 3e-5 and 0 < sign_flip_p(np.ones(n)) < 5e-5


@pytest.mark.parametrize("draw", sorted(NO_EFFECT))
def test_verdict_false_positive_rate_at_most_alpha(draw):
    """No effect: a verdict of either kind, better or worse, at most alpha of the time at every n from 3 to 12.

    A verdict whose side is picked after seeing the data (one-sided p <= alpha on either side) is wrong twice as
    often: ~6% at 5 seeds, ~10% at 6-12."""
    rng = np.random.default_rng(sorted(NO_EFFECT).index(draw))
    for n in range(3, 13):
        side = verdicts(NO_EFFECT[draw](rng, (TRIALS, n)))
        assert np.mean(side != 0) <= BOUND, (draw, n, np.mean(side == 1), np.mean(side == -1))
        if n < fewest_seeds(1, ALPHA):
            assert not side.any()  # up to 5 seeds even all agreeing give p = 2 * 2^-n >= 0.0625
        # a side named before the runs: its one-sided verdict at most alpha, none on the other side
        expected = verdicts(NO_EFFECT[draw](rng, (TRIALS, n)), expect=WORSE)
        assert np.mean(expected == -1) <= BOUND and not (expected == 1).any(), (draw, n)


def test_family_false_positive_rate_at_most_alpha():
    """Five metrics of one comparison under no effect: any verdict among them at most alpha (Holm, one family)."""
    rng = np.random.default_rng(5)
    n, metrics, trials = 8, 5, 1000
    diffs = rng.standard_t(2, (trials, metrics, n))
    p = sign_flip_p(diffs.reshape(-1, n)).reshape(trials, metrics)
    any_verdict = [
        verdict_side(diffs[t].mean(axis=1), np.array(holm(list(p[t]))), ALPHA).any() for t in range(trials)
    ]
    assert np.mean(any_verdict) <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / trials)


@pytest.mark.parametrize("expect", [None, BETTER, WORSE])
def test_verdicts_are_the_reports(expect):
    """The vectorised verdict the simulations use is paired_stat's and paired_family's, draw by draw."""
    rng = np.random.default_rng(2)
    for n in range(3, 9):
        diffs = rng.normal(0.8, 1.0, (12, n)) * rng.choice((-1, 1), (12, 1))  # both sides, about half significant
        names = {1: BETTER, -1: WORSE, 0: INCONCLUSIVE}
        for row, side in zip(diffs, verdicts(diffs, expect)):
            stat = paired_stat("x", dict(enumerate(np.zeros(n))), dict(enumerate(row)), expect=expect)
            assert stat.verdict == names[side]
            assert paired_family({"x": stat})["x"].verdict == stat.verdict
            # lower is better: the same differences the other way round give the same verdict
            flipped = paired_stat("t", dict(enumerate(row)), dict(enumerate(np.zeros(n))), False, expect)
            assert flipped.verdict == stat.verdict


def test_verdict_power_on_a_known_effect():
    """Normal differences of one standard deviation: at 6 seeds the verdict is 'better' exactly when all 6 agree
    (probability Phi(1)^6 = 0.355); at 10 about as often as the paired t-test's 80%; never 'worse'."""
    rng = np.random.default_rng(9)
    six = verdicts(rng.normal(1.0, 1.0, (TRIALS, 6)))
    exact = NormalDist().cdf(1.0) ** 6
    assert np.mean(six == 1) == pytest.approx(exact, abs=3 * math.sqrt(exact * (1 - exact) / TRIALS))
    ten = verdicts(rng.normal(1.0, 1.0, (TRIALS, 10)))
    assert np.mean(ten == 1) >= 0.75 and not (ten == -1).any()
    # the side named before the runs buys power: one-sided at 10 seeds, ~0.89
    assert np.mean(verdicts(rng.normal(1.0, 1.0, (TRIALS, 10)), expect=BETTER) == 1) >= 0.85


def test_fewest_seeds_that_can_reach_alpha():
    assert fewest_seeds(1, 0.05) == 6 and 2 * 0.5**6 <= 0.05 < 2 * 0.5**5  # two-sided, one metric
    assert fewest_seeds(5, 0.05) == 8  # five metrics under Holm: 5 * 2 * 2^-8 = 0.039
    assert fewest_seeds(1, 0.05, two_sided=False) == 5 and fewest_seeds(5, 0.05, two_sided=False) == 7


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
    assert verdict_text("better", 6, 6, 1 / 32, 1 / 32, 0.05) == "better (6 of 6 seeds, p = 0.031)"
    assert verdict_text("worse", 7, 8, 0.0078, 0.02, 0.05) == "worse (7 of 8 seeds, p = 0.008, Holm 0.020)"
    assert verdict_text("better", 3, 3, 0.25, 0.25, 0.05) == (
        "all 3 seeds agree, better (p = 0.250: not significant at 5%)"
    )
    assert verdict_text("better", 5, 5, 1 / 16, 5 / 16, 0.05) == (
        "all 5 seeds agree, better (p = 0.062, Holm 0.312: not significant at 5%)"
    )
    assert verdict_text("worse", 2, 2, 0.5, 0.5, 0.05) == "both seeds agree, worse (p = 0.500: not significant at 5%)"
    assert verdict_text("better", 2, 3, 0.75, 0.75, 0.05) == "inconclusive"
    assert verdict_text("better", 1, 1, None, None, 0.05) == "inconclusive"
    assert verdict_text("better", 12, 12, 0.0004, 0.0004, 0.05) == "better (12 of 12 seeds, p < 0.001)"
    # a side named before the runs: its one-sided p, and the other side is not tested
    assert verdict_text("better", 5, 5, 1 / 32, 1 / 32, 0.05, BETTER) == "better (5 of 5 seeds, one-sided p = 0.031)"
    assert verdict_text("worse", 5, 5, 1.0, 1.0, 0.05, BETTER) == (
        "all 5 seeds agree, worse: the opposite of the expected better, not tested"
    )
    assert verdict_text("worse", 4, 5, 0.9, 0.9, 0.05, BETTER) == "inconclusive"


def test_saved_verdicts_recompute_two_sided():
    """benchmarks/paired_from_table.py on a saved report (the python tool, 5 seeds that all agree): p = 2 * 2^-5
    per metric, Holm 0.312 across the five, "all 5 seeds agree", not "better"; as verdicts_2026-12-07 keeps it."""
    root = Path(__file__).resolve().parents[2]
    table = "docs/results/python_tool_2026-12-02/comparison/runs.csv"
    out = subprocess.run([sys.executable, "benchmarks/paired_from_table.py", table], cwd=root, capture_output=True,
                         text=True, check=True, timeout=120).stdout
    final = next(line for line in out.splitlines() if line.startswith("| `arithmetic_python` | final |"))
    assert "| 0.062 (0.312) | 5/5 | all 5 seeds agree, better (p = 0.062, Holm 0.312: not significant at 5%) |" in final
    assert final in (root / "docs/results/verdicts_2026-12-07/recomputed.txt").read_text()


def test_false_positive_benchmark_runs():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "benchmarks/verdict_false_positives.py", "--draws", "20", "--seeds", "6"],
                         cwd=root, capture_output=True, text=True, check=True, timeout=120).stdout
    assert "| normal | 6 |" in out and "| t2 | 6 |" in out
