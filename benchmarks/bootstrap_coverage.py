"""Coverage of `podsrl compare`'s expanded percentile bootstrap interval, by simulation, for each number of seeds.

    python benchmarks/bootstrap_coverage.py --n 2 3 4 5 6 7 8 10 12 15 20 --draws 2000 > coverage.txt

For each n: `draws` samples of n paired differences from a normal with mean 0.3 and SD 1 (any mean and SD give the
same coverage: the interval is equivariant), each through podsrl/experiments/stats.py's `bootstrap_interval` (the
report's own code, 10,000 resamples), and the share of intervals that hold the true mean, with its binomial standard
error. Beside it, how often the interval is exactly [min d, max d] (then it is the range of the n differences, which
covers the median of any continuous distribution with probability 1 - 2 * 2^-n). The labels of the report
(podsrl/experiments/paired_test.py, NOMINAL_FROM) rest on this table: docs/results/bootstrap_coverage_2026-12-01/.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from podsrl.experiments.stats import bootstrap_interval  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 20])
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"normal differences, mean 0.3, sd 1; {args.draws} draws per n; expanded bootstrap, 10,000 resamples")
    print("n | coverage of the mean | binomial s.e. | interval = range | range's coverage of the median (exact)")
    for n in args.n:
        hits = ranges = 0
        for _ in range(args.draws):
            d = rng.normal(0.3, 1.0, n)
            low, high = bootstrap_interval(d)
            hits += low <= 0.3 <= high
            # isclose: a mean of n copies of a float may differ from it in the last bit
            ranges += math.isclose(low, d.min(), rel_tol=1e-12) and math.isclose(high, d.max(), rel_tol=1e-12)
        cov = hits / args.draws
        se = math.sqrt(cov * (1 - cov) / args.draws)
        print(f"{n} | {cov:.3f} | {se:.3f} | {ranges / args.draws:.3f} | {1 - 2 * 2.0**-n:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
