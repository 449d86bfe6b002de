"""The exact paired test behind `podsrl compare`'s verdicts, the level its interval really has, and their wording.

- Sign-flip permutation test of the mean paired difference: under "no effect" each difference d_s is as likely
  to be +|d_s| as -|d_s| (the two runs of a seed are exchangeable), so the p-value is the share of the 2^n sign
  patterns whose sum is at least the observed one. Exact (all patterns) for n <= EXACT_MAX, else a seeded Monte-Carlo
  sample of patterns with p = (1 + hits) / (1 + samples) (Phipson & Smyth 2010: never 0, still valid). With every
  seed agreeing the one-sided p is 2^-n: 0.125 at n = 3, 0.031 at n = 5; no result of 3 pairs can reach 5%.
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
    alternative: str = "greater",
    samples: int = SAMPLES,
    seed: int = SAMPLE_SEED,
) -> float:
    """p-value of the sign-flip test that the paired differences are centred on 0.

    alternative: "greater" (mean > 0), "less" (mean < 0) or "two-sided".
    """
    d = np.asarray(diffs, dtype=float)
    n = len(d)
    if n == 0:
        raise ValueError("a sign-flip test needs at least one difference")
    if alternative not in ("greater", "less", "two-sided"):
        raise ValueError(f"alternative must be greater, less or two-sided, got {alternative!r}")
    observed = float(d.sum())
    tol = 1e-9 * float(np.abs(d).sum())  # sums equal up to float rounding count as ties (ties count against us)

    def hits(sums: np.ndarray) -> int:
        if alternative == "greater":
            return int((sums >= observed - tol).sum())
        if alternative == "less":
            return int((sums <= observed + tol).sum())
        return int((np.abs(sums) >= abs(observed) - tol).sum())

    if n <= EXACT_MAX:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
        return hits(signs @ d) / 2**n
    rng = np.random.default_rng(seed)
    count, left = 0, samples
    while left:
        chunk = min(left, 10_000)
        count += hits(rng.choice((-1.0, 1.0), size=(chunk, n)) @ d)
        left -= chunk
    return (1 + count) / (1 + samples)


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


def verdict_text(direction: str, agree: int, n: int, p: float | None, p_holm: float | None, alpha: float) -> str:
    """The verdict in words that say what holds.

    direction: "better" or "worse", the side the mean difference lies on; agree: the seeds whose difference lies on
    that side; p: the one-sided sign-flip p on that side; p_holm: the same after Holm across the comparison's metrics.
    """
    if p is None or n < 2:
        return "inconclusive"
    held = p_holm if p_holm is not None else p
    shown = ("p " if p < 0.001 else "p = ") + format_p(p)
    shown += "" if p_holm is None or p_holm == p else f", Holm {format_p(p_holm)}"
    if held <= alpha:
        return f"{direction} ({agree} of {n} seeds, {shown})"
    if agree == n:
        both = "both seeds agree" if n == 2 else f"all {n} seeds agree"
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
