"""The exact paired test behind `podsrl compare`'s verdicts, the level its interval really has, and their wording.

- Sign-flip permutation test of the mean paired difference: under "no effect" each difference d_s is as likely
  to be +|d_s| as -|d_s| (the two runs of a seed are exchangeable), so the p-value is the share of the 2^n sign
  patterns whose sum is as extreme as the observed one: two-sided, |sum| >= |observed| (the verdict's test), or
  one-sided on a side named before the runs (`--expect`). Exact (all patterns) for n <= EXACT_MAX, else a seeded
  Monte-Carlo sample of patterns with p = (1 + hits) / (1 + samples) (Phipson & Smyth 2010: never 0, still valid).
  With every seed agreeing the two-sided p is 2 * 2^-n: 0.25 at n = 3, 0.0625 at n = 5, 0.031 at n = 6; no result
  of 5 pairs can reach 5% (one-sided: 2^-n, 5 pairs). Picking the side after seeing the data and quoting its
  one-sided p would double the false-positive rate: that is not a test.
- Holm's step-down correction across the metrics one comparison reports (they are tested on the same runs).
- The interval's real level: a percentile bootstrap never leaves [min d, max d], and the expanded one *is* that
  range for few seeds; the range of n draws covers the median of any continuous distribution with probability
  exactly 1 - 2 * 2^-n (75% at n = 3). Above RANGE_UP_TO seeds the level is the simulated coverage
  (benchmarks/bootstrap_coverage.py) until it reaches the nominal one at NOMINAL_FROM.
- Seeds needed as a range: the chi-square interval of the SD of the differences, put through the sample-size formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

EXACT_MAX = 16  # 2^16 patterns x 16 seeds: ~1M signs, milliseconds
SAMPLES = 100_000  # beyond EXACT_MAX: the p-value's Monte-Carlo s.e. is < 0.0007 at p = 0.05
SAMPLE_SEED = 0  # the p-value is a pure function of the differences: same runs, same report
# docs/results/bootstrap_coverage_2026-12-01/coverage.txt (normal differences, 4,000 draws per n): up to
# RANGE_UP_TO seeds the expanded bootstrap interval is the range of the differences (in every draw); from
# NOMINAL_FROM seeds its coverage of the mean is within two standard errors (0.008) of 95%; in between, what it
# measured (0.919, 0.938, 0.939 at n = 5, 6, 7).
RANGE_UP_TO = 4
NOMINAL_FROM = 8
MEASURED_COVERAGE = {5: 0.92, 6: 0.94, 7: 0.94}


def sign_flip_p(
    diffs: Sequence[float] | np.ndarray,
    alternative: str = "two-sided",
    samples: int = SAMPLES,
    seed: int = SAMPLE_SEED,
) -> float | np.ndarray:
    """p-value of the sign-flip test that the paired differences are centred on 0.

    alternative: "two-sided" (|sum| >= |observed|), "greater" (mean > 0) or "less" (mean < 0). `diffs` is one
    comparison's n differences (returns a float) or a 2-D array, one comparison per row (returns one p per row:
    the same patterns for every row, one matrix product for all).
    """
    d = np.asarray(diffs, dtype=float)
    rows = np.atleast_2d(d)
    n = rows.shape[1]
    if n == 0:
        raise ValueError("a sign-flip test needs at least one difference")
    if alternative not in ("greater", "less", "two-sided"):
        raise ValueError(f"alternative must be greater, less or two-sided, got {alternative!r}")
    if n <= EXACT_MAX:
        signs = 1.0 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
        per_block = max(1, 2**22 // 2**n)  # rows per matrix product: ~4M sums in memory at a time
        p = np.concatenate(
            [_hits(rows[i:i + per_block], signs, alternative) for i in range(0, len(rows), per_block)]
        ) / 2**n
    else:
        rng = np.random.default_rng(seed)
        count = np.zeros(len(rows), dtype=np.int64)
        for start in range(0, samples, 10_000):
            count += _hits(rows, rng.choice((-1.0, 1.0), size=(min(10_000, samples - start), n)), alternative)
        p = (1 + count) / (1 + samples)
    return float(p[0]) if d.ndim == 1 else p


def _hits(rows: np.ndarray, signs: np.ndarray, alternative: str) -> np.ndarray:
    """Per row, the sign patterns whose sum is as extreme as the observed one (ties within float rounding count)."""
    observed = rows.sum(axis=1)[:, None]
    tol = 1e-9 * np.abs(rows).sum(axis=1)[:, None]
    sums = rows @ signs.T  # [rows, patterns]
    if alternative == "greater":
        return (sums >= observed - tol).sum(axis=1)
    if alternative == "less":
        return (sums <= observed + tol).sum(axis=1)
    return (np.abs(sums) >= np.abs(observed) - tol).sum(axis=1)


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm-adjusted p-values (None stays None and is not counted among the tests)."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m = len(tested)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))  # step-down: never below an earlier adjusted p
        out[i] = running
    return out


def range_coverage(n: int) -> float:
    """Probability that the range of n continuous draws holds their median: 1 - 2 * 2^-n."""
    return 1 - 2 * 0.5**n


def interval_level(n: int, alpha: float) -> str:
    """What the report's interval of n paired differences is and the level it has: 'range, ~75% for the median'."""
    if n < 2:
        return "none"
    if n <= RANGE_UP_TO:
        return f"range, ~{range_coverage(n):.0%} for the median"
    if n < NOMINAL_FROM:
        return f"bootstrap, ~{MEASURED_COVERAGE[n]:.0%}"
    return f"bootstrap {1 - alpha:.0%}"


def interval_label(n: int, alpha: float) -> str:
    """interval_level with its n: 'n = 3: range, ~75% for the median' (a table header may hold several)."""
    return f"n = {n}: {interval_level(n, alpha)}"


def format_p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def fewest_seeds(tests: int, alpha: float, two_sided: bool = True) -> int:
    """The fewest pairs with which the sign-flip test can pass at all: every seed agreeing gives p = 2^-n
    (two-sided: twice that), times `tests` after Holm at worst. One metric two-sided: 6 (2 * 2^-6 = 0.031)."""
    return math.ceil(math.log2((2 if two_sided else 1) * tests / alpha) - 1e-12)


def alternative_for(expect: str | None, higher_is_better: bool = True) -> str:
    """sign_flip_p's alternative: two-sided unless a side ("better" / "worse") was named before the runs."""
    if expect is None:
        return "two-sided"
    return "greater" if (expect == "better") == higher_is_better else "less"


def verdict_side(
    mean_diff: float | np.ndarray,
    p_holm: float | np.ndarray,
    alpha: float,
    higher_is_better: bool = True,
    expect: str | None = None,
) -> int | np.ndarray:
    """The verdict as a number: +1 better, -1 worse, 0 inconclusive (arrays: one per comparison).

    Two-sided (expect None): significant on the side the mean difference lies on. With a side named before the
    runs (expect "better" or "worse", p one-sided for it), only that side can be declared.
    """
    good = np.sign(mean_diff) * (1 if higher_is_better else -1)
    side = np.where(np.asarray(p_holm) <= alpha, good, 0)
    if expect is not None:
        side = np.where(side == (1 if expect == "better" else -1), side, 0)
    return int(side) if side.ndim == 0 else side.astype(int)


def verdict_text(
    direction: str,
    agree: int,
    n: int,
    p: float | None,
    p_holm: float | None,
    alpha: float,
    expect: str | None = None,
) -> str:
    """The verdict in words that say what holds.

    direction: "better" or "worse", the side the mean difference lies on; agree: the seeds whose difference lies on
    that side; p: the sign-flip p (two-sided, or one-sided for `expect` when a side was named before the runs);
    p_holm: the same after Holm across the comparison's metrics.
    """
    if p is None or n < 2:
        return "inconclusive"
    both = "both seeds agree" if n == 2 else f"all {n} seeds agree"
    if expect is not None and direction != expect:  # the side not named before the runs is not tested
        return f"{both}, {direction}: the opposite of the expected {expect}, not tested" if agree == n else (
            "inconclusive")
    held = p_holm if p_holm is not None else p
    shown = ("one-sided " if expect else "") + ("p " if p < 0.001 else "p = ") + format_p(p)
    shown += "" if p_holm is None or p_holm == p else f", Holm {format_p(p_holm)}"
    if held <= alpha:
        return f"{direction} ({agree} of {n} seeds, {shown})"
    if agree == n:
        return f"{both}, {direction} ({shown}: not significant at {alpha:.0%})"
    return "inconclusive"


def _lower_gamma_regularized(a: float, x: float) -> float:
    """P(a, x) by its power series (converges for every x; the few hundred terms needed here are cheap)."""
    if x <= 0:
        return 0.0
    term = total = 1.0 / a
    k = 0
    while term > total * 1e-15:
        k += 1
        term *= x / (a + k)
        total += term
    return min(1.0, math.exp(a * math.log(x) - x - math.lgamma(a)) * total)


def chi2_quantile(p: float, df: int) -> float:
    """Quantile of the chi-square distribution with `df` degrees of freedom (bisection on its CDF)."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"need 0 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, float(df) + 10 * math.sqrt(2 * df) + 10
    while _lower_gamma_regularized(df / 2, hi / 2) < p:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _lower_gamma_regularized(df / 2, mid / 2) < p else (lo, mid)
    return (lo + hi) / 2


def sd_interval(sd: float, n: int, alpha: float) -> tuple[float, float]:
    """(1 - alpha) interval of the SD of normal differences from the sample SD of n of them (n >= 2)."""
    df = n - 1
    return (
        sd * math.sqrt(df / chi2_quantile(1 - alpha / 2, df)),
        sd * math.sqrt(df / chi2_quantile(alpha / 2, df)),
    )
