"""Paired-by-seed statistics of a method against the baseline: difference, bootstrap interval, verdict, seeds.

Seed s of the method is paired with seed s of the baseline (same warm-up, same held-out set, same prompt stream
for the first step); the unit of evidence is the per-seed difference d_s = method_s - baseline_s.

- Interval: the *expanded* percentile bootstrap of the mean of d (Hesterberg 2015, "What teachers should know
  about the bootstrap", §5): B resamples of the n differences with replacement; the percentiles are taken at
  alpha'/2 and 1 - alpha'/2 with Phi^-1(alpha'/2) = -sqrt(n/(n-1)) * t_{n-1, 1-alpha/2}. The plain percentile
  interval is too narrow for small n (it ignores that the spread itself is estimated); the expansion makes it
  as wide as a t interval would be. A percentile bootstrap can never leave [min d, max d]: up to 4 seeds the
  interval is the range of the differences, ~75% for the median with 3 (paired_test.interval_label names each n's
  level; docs/statistics.md).
- Verdict (podsrl/experiments/paired_test.py): the exact two-sided sign-flip test of the mean difference,
  Holm-corrected across the metrics of one comparison (`paired_family`, one family); "better" / "worse" (the side the
  mean lies on) when that p <= alpha, "all n seeds agree" when every seed lies on one side but p > alpha, else
  "inconclusive". Under no effect a verdict of either kind is wrong at most alpha of the time. With a side named
  before the runs (`expect`, `podsrl compare --expect better`) the p is one-sided for that side and only that side
  can be declared. The interval describes the size of the difference and decides nothing. Fewer than 2 pairs:
  always inconclusive.
- Seeds needed (not significant only): the smallest n with n >= ((t_{n-1, 1-alpha/2} + t_{n-1, power}) * s / |dbar|)^2,
  the paired t-test sample size (normal approximation of the non-central t, iterated on the t quantiles) to
  detect the observed mean difference dbar at the observed standard deviation s of the differences, alpha = 0.05
  (one-sided with `expect`), power 0.8. At least n + 1 (more seeds than were run), and at least the fewest with
  which the exact test can pass at all (2 * 2^-n * metrics <= alpha; one-sided 2^-n * metrics: fewest_seeds). An
  estimate from the observed spread, which is itself uncertain: the range puts the ends of the spread's chi-square
  (1 - alpha) interval through the same formula.
  None when dbar = 0 or s is unknown (< 2 pairs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

from podsrl.experiments.paired_test import (
    alternative_for,
    fewest_seeds,
    format_p,
    holm,
    sd_interval,
    sign_flip_p,
    verdict_side,
    verdict_text,
)

ALPHA = 0.05
POWER = 0.8
MAX_SEEDS = 1000  # beyond this, "seeds to resolve" reads as: no difference worth resolving
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # the interval is a pure function of the differences: same runs, same report
BETTER, WORSE, INCONCLUSIVE = "better", "worse", "inconclusive"


@functools.lru_cache(maxsize=4096)  # sample sizes iterate over df: the same few quantiles recur
def t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t with `df` degrees of freedom (closed form for df 1 and 2, else bisection on the CDF).

    The CDF is the integral of the density from 0, by Simpson's rule on 2,000 intervals: accurate to ~1e-9 for the
    quantiles used here (|t| < 15), without a scipy dependency.
    """
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"need 0 < p < 1 and df >= 1, got p={p}, df={df}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    if p < 0.5:
        return -t_quantile(1 - p, df)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        grid = np.linspace(0.0, x, 2001)
        dens = np.exp(log_norm - (df + 1) / 2 * np.log1p(grid**2 / df))
        simpson = dens[0] + dens[-1] + 4 * dens[1:-1:2].sum() + 2 * dens[2:-1:2].sum()
        return 0.5 + float(simpson) * (x / 2000) / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def bootstrap_interval(
    diffs: Sequence[float] | np.ndarray,
    alpha: float = ALPHA,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float]:
    """Expanded percentile bootstrap (1 - alpha) interval of the mean of `diffs` (n >= 2)."""
    d = np.asarray(diffs, dtype=float)
    n = len(d)
    if n < 2:
        raise ValueError(f"a bootstrap interval needs >= 2 values, got {n}")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    z = math.sqrt(n / (n - 1)) * t_quantile(1 - alpha / 2, n - 1)
    tail = NormalDist().cdf(-z)
    # 'inverted_cdf' keeps the interval on resampled means (e.g. the min and max of d for tiny tails).
    low, high = np.quantile(means, [tail, 1 - tail], method="inverted_cdf")
    return float(low), float(high)


def seeds_needed(
    mean_diff: float, sd_diff: float, alpha: float = ALPHA, power: float = POWER, two_sided: bool = True
) -> int | None:
    """Paired-t sample size to detect `mean_diff` at spread `sd_diff` (see the module docstring); None if 0,
    MAX_SEEDS + 1 for any size above MAX_SEEDS (`seeds_text` writes it as "> 1000")."""
    if mean_diff == 0 or not math.isfinite(sd_diff):
        return None
    if sd_diff == 0:
        return 2
    effect = abs(mean_diff) / sd_diff
    level = 1 - alpha / 2 if two_sided else 1 - alpha
    z = NormalDist().inv_cdf(level) + NormalDist().inv_cdf(power)
    n = max(2, math.floor((z / effect) ** 2))  # the normal-theory size; t quantiles only ever raise it
    if n > MAX_SEEDS:
        return MAX_SEEDS + 1
    while n < ((t_quantile(level, n - 1) + t_quantile(power, n - 1)) / effect) ** 2:
        n += 1
    return n


def seeds_text(needed: int) -> str:
    return f"> {MAX_SEEDS}" if needed > MAX_SEEDS else f"~{needed}"


def seeds_range_text(needed: int, low: int | None, high: int | None) -> str:
    """'~9 (4-340)': the estimate and the range from the spread's own interval."""
    if low is None or high is None or min(low, MAX_SEEDS + 1) == min(high, MAX_SEEDS + 1):
        return seeds_text(needed)
    low_text, high_text = (f">{MAX_SEEDS}" if k > MAX_SEEDS else str(k) for k in (low, high))
    return f"{seeds_text(needed)} ({low_text}–{high_text})"


@dataclass(frozen=True)
class PairedStat:
    """A method's paired difference to the baseline on one metric."""

    metric: str
    higher_is_better: bool
    pairs: int  # seeds where both runs have a value
    seeds: int  # seeds the method shares with the baseline
    mean_diff: float | None  # mean of method - baseline over the pairs
    sd_diff: float | None  # sample standard deviation (ddof=1) of the differences
    ci_low: float | None
    ci_high: float | None
    verdict: str  # BETTER, WORSE or INCONCLUSIVE (an "all seeds agree" that is not significant included)
    seeds_needed: int | None  # only for an inconclusive verdict with >= 2 pairs
    seeds_low: int | None = None  # seeds_needed at the ends of the spread's (1 - alpha) interval
    seeds_high: int | None = None
    p_value: float | None = None  # sign-flip p: two-sided, or one-sided for `expect` (>= 2 pairs)
    p_holm: float | None = None  # the same after Holm across the comparison's metrics
    expect: str | None = None  # BETTER or WORSE when that side was named before the runs, else None
    above: int = 0  # pairs with method > baseline
    below: int = 0  # pairs with method < baseline
    words: str = INCONCLUSIVE  # the verdict as paired_test.verdict_text words it

    @property
    def direction(self) -> str:
        """The side the mean difference lies on, in the metric's good direction."""
        if not self.mean_diff:  # None or 0: no side
            return BETTER
        return BETTER if (self.mean_diff > 0) == self.higher_is_better else WORSE

    def short(self, digits: int = 3) -> str:
        """For a plot legend: "+0.021 [+0.010, +0.030] better, Holm p = 0.020" (or "... all 3 agree, Holm p = 1.000")."""
        if self.mean_diff is None:
            return "no pairs"
        text = f"{self.mean_diff:+.{digits}f}"
        if self.ci_low is not None and self.ci_high is not None:
            text += f" [{self.ci_low:+.{digits}f}, {self.ci_high:+.{digits}f}]"
        agree = max(self.above, self.below) == self.pairs and self.verdict == INCONCLUSIVE
        text += f" all {self.pairs} agree" if agree else f" {self.verdict}"
        if self.p_holm is not None:
            text += f", Holm p {'< ' if self.p_holm < 0.001 else '= '}{format_p(self.p_holm)}"
        return text


def _decide(stat: PairedStat, p_holm: float | None, alpha: float = ALPHA, tests: int = 1) -> PairedStat:
    """Verdict, its words and seeds needed from the (Holm-adjusted over `tests` metrics) p-value."""
    if stat.p_value is None or stat.mean_diff is None or stat.sd_diff is None or p_holm is None:
        return stat
    side = verdict_side(stat.mean_diff, p_holm, alpha, stat.higher_is_better, stat.expect)
    verdict = {1: BETTER, -1: WORSE, 0: INCONCLUSIVE}[side]
    agree = stat.above if (stat.direction == WORSE) != stat.higher_is_better else stat.below  # seeds on that side
    words = verdict_text(stat.direction, agree, stat.pairs, stat.p_value, p_holm, alpha, stat.expect)
    needed = low = high = None
    if verdict == INCONCLUSIVE and stat.expect in (None, stat.direction):  # none against the expected side
        two_sided = stat.expect is None
        floor = max(stat.pairs + 1, fewest_seeds(tests, alpha, two_sided))
        formula = seeds_needed(stat.mean_diff, stat.sd_diff, two_sided=two_sided)
        if formula is not None:
            needed = max(formula, floor)
            sd_lo, sd_hi = sd_interval(stat.sd_diff, stat.pairs, alpha)
            low, high = (max(seeds_needed(stat.mean_diff, sd, two_sided=two_sided) or 2, floor)
                         for sd in (sd_lo, sd_hi))
    return replace(stat, verdict=verdict, words=words, seeds_needed=needed, seeds_low=low, seeds_high=high,
                   p_holm=p_holm)


def paired_stat(
    metric: str,
    baseline: Mapping[int | None, float | None],
    method: Mapping[int | None, float | None],
    higher_is_better: bool = True,
    expect: str | None = None,
) -> PairedStat:
    """Pair the two configs' values by seed and summarise method - baseline (missing values drop the pair).

    expect: BETTER or WORSE when that side was named before the runs (one-sided test, no verdict on the other
    side), None for the two-sided test. The verdict is this metric's alone; `paired_family` corrects it for the
    other metrics of the comparison."""
    if expect not in (None, BETTER, WORSE):
        raise ValueError(f"expect must be {BETTER!r}, {WORSE!r} or None, got {expect!r}")
    shared = [s for s in method if s in baseline]
    diffs = np.array(
        [method[s] - baseline[s] for s in shared if method[s] is not None and baseline[s] is not None],  # type: ignore[operator]
        dtype=float,
    )
    n = len(diffs)
    if n == 0:
        return PairedStat(metric, higher_is_better, 0, len(shared), None, None, None, None, INCONCLUSIVE, None,
                          expect=expect)
    mean = float(diffs.mean())
    if n < 2:
        return PairedStat(metric, higher_is_better, 1, len(shared), mean, None, None, None, INCONCLUSIVE, None,
                          expect=expect)
    low, high = bootstrap_interval(diffs)
    p = sign_flip_p(diffs, alternative_for(expect, higher_is_better))
    stat = PairedStat(
        metric, higher_is_better, n, len(shared), mean, float(diffs.std(ddof=1)), low, high, INCONCLUSIVE, None,
        p_value=p,
        expect=expect,
        above=int((diffs > 0).sum()),
        below=int((diffs < 0).sum()),
    )
    return _decide(stat, p)


def paired_family(stats: Mapping[str, PairedStat], alpha: float = ALPHA) -> dict[str, PairedStat]:
    """The metrics of one comparison, their verdicts Holm-corrected across them (one family, both directions)."""
    names = list(stats)
    adjusted = holm([stats[m].p_value for m in names])
    tests = sum(p is not None for p in adjusted)
    return {m: _decide(stats[m], p, alpha, tests) for m, p in zip(names, adjusted)}
