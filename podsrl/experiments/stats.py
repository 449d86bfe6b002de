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
- Verdict (podsrl/experiments/paired_test.py): the exact sign-flip test of the mean difference, one-sided in each
  direction, Holm-corrected across the metrics of one comparison (`paired_family`); "better" / "worse" when that
  p <= alpha, "all n seeds agree" when every seed lies on one side but p > alpha, else "inconclusive". Each direction's
  claims are wrong at most alpha of the time under no effect. The interval describes the size of the difference and
  decides nothing. Fewer than 2 pairs: always inconclusive.
- Seeds needed (not significant only): the smallest n with n >= ((t_{n-1, 1-alpha/2} + t_{n-1, power}) * s / |dbar|)^2,
  the paired t-test sample size (normal approximation of the non-central t, iterated on the t quantiles) to
  detect the observed mean difference dbar at the observed standard deviation s of the differences, two-sided
  alpha = 0.05, power 0.8. At least n + 1 (more seeds than were run), and at least the fewest with which the exact
  test can pass at all (2^-n * metrics <= alpha). An estimate from the observed spread, which is
  itself uncertain: the range puts the ends of the spread's chi-square (1 - alpha) interval through the same formula.
  None when dbar = 0 or s is unknown (< 2 pairs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

from podsrl.experiments.paired_test import format_p, holm, sd_interval, sign_flip_p, verdict_text

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


def seeds_needed(mean_diff: float, sd_diff: float, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Paired-t sample size to detect `mean_diff` at spread `sd_diff` (see the module docstring); None if 0,
    MAX_SEEDS + 1 for any size above MAX_SEEDS (`seeds_text` writes it as "> 1000")."""
    if mean_diff == 0 or not math.isfinite(sd_diff):
        return None
    if sd_diff == 0:
        return 2
    effect = abs(mean_diff) / sd_diff
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    n = max(2, math.floor((z / effect) ** 2))  # the normal-theory size; t quantiles only ever raise it
    if n > MAX_SEEDS:
        return MAX_SEEDS + 1
    while n < ((t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) / effect) ** 2:
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
    p_better: float | None = None  # one-sided sign-flip p that the method is better (>= 2 pairs)
    p_worse: float | None = None
    holm_better: float | None = None  # the same after Holm across the comparison's metrics
    holm_worse: float | None = None
    above: int = 0  # pairs with method > baseline
    below: int = 0  # pairs with method < baseline
    words: str = INCONCLUSIVE  # the verdict as paired_test.verdict_text words it

    @property
    def direction(self) -> str:
        worse = self.p_worse is not None and self.p_better is not None and self.p_worse < self.p_better
        return WORSE if worse else BETTER

    @property
    def p_value(self) -> float | None:
        """One-sided p on the side the mean difference lies on."""
        return self.p_worse if self.direction == WORSE else self.p_better

    @property
    def p_holm(self) -> float | None:
        return self.holm_worse if self.direction == WORSE else self.holm_better

    def short(self, digits: int = 3) -> str:
        """For a plot legend: "+0.021 [+0.010, +0.030] better, Holm p = 0.020" (or "... all 3 agree, Holm p = 0.625")."""
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


def _decide(
    stat: PairedStat, holm_better: float | None, holm_worse: float | None, alpha: float = ALPHA, tests: int = 1
) -> PairedStat:
    """Verdict, its words and seeds needed from the (Holm-adjusted over `tests` metrics) one-sided p-values."""
    if stat.p_better is None or stat.mean_diff is None or stat.sd_diff is None:
        return stat
    verdict = BETTER if holm_better <= alpha else WORSE if holm_worse <= alpha else INCONCLUSIVE  # type: ignore[operator]
    worse_side = stat.direction == WORSE
    agree = stat.above if worse_side != stat.higher_is_better else stat.below  # seeds on that side
    words = verdict_text(
        WORSE if worse_side else BETTER,
        agree,
        stat.pairs,
        stat.p_worse if worse_side else stat.p_better,
        holm_worse if worse_side else holm_better,
        alpha,
    )
    needed = low = high = None
    if verdict == INCONCLUSIVE:
        # the exact test's floor: n seeds all agreeing give p = 2^-n, times `tests` after Holm at worst
        floor = max(stat.pairs + 1, math.ceil(math.log2(tests / alpha)))
        formula = seeds_needed(stat.mean_diff, stat.sd_diff)
        if formula is not None:
            needed = max(formula, floor)
            sd_lo, sd_hi = sd_interval(stat.sd_diff, stat.pairs, alpha)
            low, high = (max(seeds_needed(stat.mean_diff, sd) or 2, floor) for sd in (sd_lo, sd_hi))
    return replace(
        stat, verdict=verdict, words=words, seeds_needed=needed, seeds_low=low, seeds_high=high,
        holm_better=holm_better, holm_worse=holm_worse,
    )


def paired_stat(
    metric: str,
    baseline: Mapping[int | None, float | None],
    method: Mapping[int | None, float | None],
    higher_is_better: bool = True,
) -> PairedStat:
    """Pair the two configs' values by seed and summarise method - baseline (missing values drop the pair).

    The verdict is this metric's alone; `paired_family` corrects it for the other metrics of the comparison."""
    shared = [s for s in method if s in baseline]
    diffs = np.array(
        [method[s] - baseline[s] for s in shared if method[s] is not None and baseline[s] is not None],  # type: ignore[operator]
        dtype=float,
    )
    n = len(diffs)
    if n == 0:
        return PairedStat(metric, higher_is_better, 0, len(shared), None, None, None, None, INCONCLUSIVE, None)
    mean = float(diffs.mean())
    if n < 2:
        return PairedStat(metric, higher_is_better, 1, len(shared), mean, None, None, None, INCONCLUSIVE, None)
    low, high = bootstrap_interval(diffs)
    up, down = sign_flip_p(diffs, "greater"), sign_flip_p(diffs, "less")
    stat = PairedStat(
        metric, higher_is_better, n, len(shared), mean, float(diffs.std(ddof=1)), low, high, INCONCLUSIVE, None,
        p_better=up if higher_is_better else down,
        p_worse=down if higher_is_better else up,
        above=int((diffs > 0).sum()),
        below=int((diffs < 0).sum()),
    )
    return _decide(stat, stat.p_better, stat.p_worse)


def paired_family(stats: Mapping[str, PairedStat], alpha: float = ALPHA) -> dict[str, PairedStat]:
    """The metrics of one comparison, their verdicts Holm-corrected across them (each direction its own family)."""
    names = list(stats)
    better = holm([stats[m].p_better for m in names])
    worse = holm([stats[m].p_worse for m in names])
    tests = sum(p is not None for p in better)
    return {m: _decide(stats[m], b, w, alpha, tests) for m, b, w in zip(names, better, worse)}
