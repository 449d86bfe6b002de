"""Paired-by-seed statistics: t quantiles, sample sizes, the bootstrap interval's coverage, verdicts on synthetic
curves with known answers, and their place in the report files and the plot legend."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from podsrl.experiments.analysis import area_under_curve, compare_runs, load_run
from podsrl.experiments.plots import paired_legend
from podsrl.experiments.report import build_report, verdict_lines
from podsrl.experiments.stats import (
    BETTER,
    INCONCLUSIVE,
    MAX_SEEDS,
    WORSE,
    bootstrap_interval,
    paired_stat,
    seeds_needed,
    seeds_range_text,
    seeds_text,
    t_quantile,
)
from tests.experiments.test_experiments import write_run


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [(0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 4, 2.776445), (0.975, 9, 2.262157),
     (0.8, 9, 0.883404), (0.025, 29, -2.045230), (0.975, 1000, 1.962339)],
)
def test_t_quantile_matches_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-5)


def test_seeds_needed_matches_paired_t_power_tables():
    # Paired t-test, two-sided 0.05, power 0.8 (G*Power): effect size 1 -> 10 pairs, 0.5 -> 34, 0.8 -> 15.
    assert seeds_needed(1.0, 1.0) == 10
    assert seeds_needed(-0.5, 1.0) == 34
    assert seeds_needed(0.8, 1.0) == 15
    assert seeds_needed(0.0, 1.0) is None
    assert seeds_needed(0.3, 0.0) == 2
    # a float-rounding difference (1e-9 at spread 0.01) is capped, not a 14-digit seed count
    assert seeds_needed(1e-9, 0.01) == MAX_SEEDS + 1 and seeds_text(MAX_SEEDS + 1) == "> 1000"
    assert seeds_text(34) == "~34"


def test_bootstrap_interval_of_three_is_their_range_and_deterministic():
    d = [0.01, 0.05, 0.03]
    assert bootstrap_interval(d) == pytest.approx((0.01, 0.05))
    assert bootstrap_interval([3.0, -1.0, 2.0, 0.5, 1.0]) == bootstrap_interval([3.0, -1.0, 2.0, 0.5, 1.0])
    with pytest.raises(ValueError):
        bootstrap_interval([1.0])


@pytest.mark.parametrize(("n", "low", "high"), [(3, 0.62, 0.86), (10, 0.89, 0.99)])
def test_bootstrap_interval_coverage(n, low, high):
    """Normal differences with mean 0.3: the share of intervals holding 0.3 (~0.75 at n=3, ~0.94 at n=10)."""
    rng = np.random.default_rng(7)
    trials = 200
    hits = sum(
        lo <= 0.3 <= hi
        for lo, hi in (bootstrap_interval(rng.normal(0.3, 1.0, n), resamples=2000, seed=t) for t in range(trials))
    )
    assert low <= hits / trials <= high


def test_paired_stat_verdicts_and_pairing():
    base = {1: 0.30, 2: 0.32, 3: 0.31, 4: 0.29, 5: 0.30, 6: 0.31}
    better = paired_stat("final", base, {1: 0.40, 2: 0.43, 3: 0.40, 4: 0.41, 5: 0.39, 6: 0.41})
    assert better.verdict == BETTER and better.pairs == 6 and better.seeds_needed is None
    assert better.mean_diff == pytest.approx(0.1017, abs=1e-4) and better.ci_low > 0
    assert better.words == "better (6 of 6 seeds, p = 0.031)"
    worse = paired_stat("final", base, {1: 0.20, 2: 0.21, 3: 0.22, 4: 0.18, 5: 0.25, 6: 0.21})
    assert worse.verdict == WORSE and worse.ci_high < 0 and worse.words == "worse (6 of 6 seeds, p = 0.031)"
    # Five seeds that agree are not evidence at 5% two-sided: p = 2 * 2^-5 = 0.0625 ...
    five = paired_stat("final", {s: base[s] for s in range(1, 6)}, {s: 0.4 + s / 100 for s in range(1, 6)})
    assert five.verdict == INCONCLUSIVE and five.words == "all 5 seeds agree, better (p = 0.062: not significant at 5%)"
    # ... unless that side was named before the runs: one-sided 2^-5 = 0.031, and no verdict on the other side
    named = paired_stat("final", {s: base[s] for s in range(1, 6)}, {s: 0.4 + s / 100 for s in range(1, 6)},
                        expect=BETTER)
    assert named.verdict == BETTER and named.words == "better (5 of 5 seeds, one-sided p = 0.031)"
    against = paired_stat("final", base, {1: 0.20, 2: 0.21, 3: 0.22, 4: 0.18, 5: 0.25, 6: 0.21}, expect=BETTER)
    assert against.verdict == INCONCLUSIVE and against.p_value == 1.0 and against.seeds_needed is None
    assert against.words == "all 6 seeds agree, worse: the opposite of the expected better, not tested"
    with pytest.raises(ValueError):
        paired_stat("final", base, base, expect="faster")
    # Three seeds that agree: p = 2/8 (lower is better here: a faster method).
    faster = paired_stat("time", {1: 100.0, 2: 90.0, 3: 120.0}, {1: 50.0, 2: 40.0, 3: 70.0}, higher_is_better=False)
    assert faster.verdict == INCONCLUSIVE and faster.mean_diff == pytest.approx(-50.0)
    assert faster.words == "all 3 seeds agree, better (p = 0.250: not significant at 5%)"
    # 6 seeds: the least a two-sided sign-flip test can say at 5% with one metric (2 * 2^-6 = 0.031)
    assert faster.seeds_needed == 6 and (faster.seeds_low, faster.seeds_high) == (6, 6)
    assert seeds_range_text(5, 5, 5) == "~5" and seeds_range_text(9, 4, 340) == "~9 (4–340)"
    assert seeds_range_text(MAX_SEEDS + 1, MAX_SEEDS + 1, MAX_SEEDS + 1) == "> 1000"
    assert seeds_range_text(600, 200, MAX_SEEDS + 1) == "~600 (200–>1000)"
    mixed = paired_stat("final", base, {1: 0.33, 2: 0.30, 3: 0.33, 4: 0.28, 5: 0.30, 6: 0.31})
    assert mixed.verdict == INCONCLUSIVE and mixed.words == "inconclusive"
    assert mixed.seeds_low <= mixed.seeds_needed <= mixed.seeds_high and mixed.seeds_needed > 6
    # Only shared seeds with values pair up; one pair has no interval and no verdict.
    partial = paired_stat("time", {1: 10.0, 2: None}, {1: 8.0, 2: 5.0, 5: 1.0}, higher_is_better=False)
    assert (partial.pairs, partial.seeds, partial.verdict, partial.ci_low) == (1, 2, INCONCLUSIVE, None)
    assert paired_stat("x", {1: 1.0}, {2: 1.0}).short() == "no pairs"


def test_area_under_curve_hand_values():
    t, acc = [0.0, 10.0, 20.0], [0.2, 0.4, 0.4]
    assert area_under_curve(t, acc, 20.0) == pytest.approx((3.0 + 4.0) / 20)
    assert area_under_curve(t, acc, 15.0) == pytest.approx((3.0 + 2.0) / 15)  # cut at 15 by interpolation
    assert area_under_curve(t, acc, 0.0) == 0.2


def _curve(times, gain, noise, rng):
    return 0.2 + gain * (1 - np.exp(-np.asarray(times) / 40.0)) + rng.normal(0, noise, len(times))


def _synthetic(tmp_path, gain_b, gain_m, noise=0.01, seeds=tuple(range(1, 9)), same_noise=False):
    """Baseline and method runs with known underlying curves; seed-level noise on every eval point."""
    times = np.linspace(0, 200, 21)
    dirs = []
    for s in seeds:
        rng = np.random.default_rng(s)
        base = _curve(times, gain_b, noise, rng)
        method = base.copy() if same_noise else _curve(times, gain_m, noise, rng)
        method += gain_m - gain_b if same_noise else 0.0
        dirs.append(write_run(tmp_path / "grpo" / f"seed{s}", times, base, seed=s, name="grpo"))
        dirs.append(write_run(tmp_path / "pods" / f"seed{s}", times, method, seed=s, name="pods"))
    return [load_run(d) for d in dirs]


def test_clear_improvement_is_better_on_every_metric(tmp_path):
    comparison = compare_runs(_synthetic(tmp_path, 0.15, 0.30), "grpo")
    paired = comparison.configs[1].paired
    assert {m: p.verdict for m, p in paired.items()} == dict.fromkeys(paired, BETTER)
    # 8 of 8 seeds: p = 2 * 2^-8 per metric, Holm across the 5 metrics multiplies the smallest by 5
    assert paired["auc"].words == "better (8 of 8 seeds, p = 0.008, Holm 0.039)"
    assert paired["auc"].mean_diff > 0 and paired["time_to_target"].mean_diff < 0
    assert comparison.configs[0].paired == {}


def test_clear_regression_is_worse(tmp_path):
    paired = compare_runs(_synthetic(tmp_path, 0.30, 0.15), "grpo").configs[1].paired
    for metric in ("final", "peak", "plateau", "auc"):
        assert paired[metric].verdict == WORSE, metric
    # The method never reaches the baseline's peak: no time pairs, no verdict on time.
    assert paired["time_to_target"].pairs == 0 and paired["time_to_target"].verdict == INCONCLUSIVE


def test_identical_curves_are_inconclusive(tmp_path):
    exact = compare_runs(_synthetic(tmp_path / "a", 0.2, 0.2, same_noise=True), "grpo").configs[1].paired
    for p in exact.values():
        assert p.verdict == INCONCLUSIVE and p.mean_diff == pytest.approx(0.0, abs=1e-12)
    # Same underlying curve, independent noise: inconclusive, with the seeds that would resolve the difference.
    noisy = compare_runs(_synthetic(tmp_path / "b", 0.2, 0.2, noise=0.02), "grpo").configs[1].paired
    assert noisy["auc"].verdict == INCONCLUSIVE
    assert noisy["auc"].seeds_needed is not None and noisy["auc"].seeds_needed > 5


def test_report_files_and_legend_carry_the_verdicts(tmp_path):
    """Three seeds that all agree: the range at its real level, p = 0.25 (Holm 1), no 'better', no '95%'."""
    runs = _synthetic(tmp_path / "runs", 0.15, 0.30, seeds=(1, 2, 3))
    rows = build_report([r.run_dir for r in runs], "grpo", tmp_path / "out")
    md = (tmp_path / "out" / "results.md").read_text()
    paired = md.split("Paired by seed against the baseline")[1].split("Per run:")[0]
    assert "[interval: n = 3: range, ~75% for the median]" in paired and "| sign-flip p (Holm) |" in paired
    assert "95%" not in paired.replace("95% interval)", "") and "**better" not in paired
    assert "| 0.250 (1.000) | 3/3 | all 3 seeds agree, better (p = 0.250, Holm 1.000: not significant at 5%) |" in md
    assert "two-sided" in paired and "No result of fewer than 6 seeds can reach p = 0.05" in md
    with (tmp_path / "out" / "results.csv").open() as f:
        pods = list(csv.DictReader(f))[1]
    assert pods["auc_verdict"] == INCONCLUSIVE and pods["final_pairs"] == "3"
    assert float(pods["auc_p"]) == 0.25 and float(pods["auc_p_holm"]) == 1.0
    assert float(pods["auc_ci_low"]) > 0 and int(pods["auc_seeds_low"]) <= int(pods["auc_seeds_needed"])
    lines = verdict_lines(rows)
    assert len(lines) == 5 and lines[0].startswith("pods vs grpo, final acc: +")
    assert "(range, ~75% for the median) (3 pairs) all 3 seeds agree, better (p = 0.250, Holm 1.000" in lines[0]
    assert "seeds would resolve it (estimate from the observed spread)" in lines[0]
    legend = paired_legend(compare_runs(runs, "grpo").configs[1].paired)
    assert legend.startswith("area under acc-vs-time / T vs baseline: +") and legend.endswith("all 3 agree, Holm p = 1.000")


@pytest.mark.parametrize(("seeds", "label"), [(5, "n = 5: bootstrap, ~92%"), (10, "n = 10: bootstrap 95%")])
def test_report_names_the_interval_level_for_more_seeds(tmp_path, seeds, label):
    runs = _synthetic(tmp_path / "runs", 0.15, 0.30, seeds=tuple(range(1, seeds + 1)))
    build_report([r.run_dir for r in runs], "grpo", tmp_path / "out")
    paired = (tmp_path / "out" / "results.md").read_text().split("Paired by seed against the baseline")[1]
    assert f"[interval: {label}" in paired


def test_report_with_the_side_named_before_the_runs(tmp_path, capsys):
    """`podsrl report --expect worse` on a clear improvement: one-sided tests for worse, and no verdict of better."""
    import argparse

    from podsrl.experiments.report import add_report_arguments, report_main

    runs = _synthetic(tmp_path / "runs", 0.15, 0.30, seeds=tuple(range(1, 7)))
    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    out = tmp_path / "out"
    assert report_main(parser.parse_args([str(tmp_path / "runs"), "--out", str(out), "--expect", "worse"])) == 0
    md = (out / "results.md").read_text()
    assert "| one-sided p for worse (Holm) |" in md and "one-sided for worse (named before the runs" in md
    assert "No result of fewer than 5 seeds can reach p = 0.05 (all 4 agreeing has p = 0.062)" in md
    assert "the opposite of the expected worse, not tested" in capsys.readouterr().out
    assert "**better" not in md and "**worse" not in md
    # the same runs without a named side: two-sided, better on the area (6 of 6 seeds, p = 0.031 before Holm)
    paired = compare_runs(runs, "grpo").configs[1].paired
    assert paired["auc"].p_value == 1 / 32 and paired["auc"].expect is None
    with pytest.raises(SystemExit):
        parser.parse_args([str(tmp_path / "runs"), "--expect", "faster"])
