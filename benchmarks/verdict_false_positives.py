"""How often `podsrl compare`'s verdict says "better" or "worse" when there is no effect, through its own paired_stat.

    python benchmarks/verdict_false_positives.py --draws 2000
    python benchmarks/verdict_false_positives.py --draws 2000 --tree /tmp/old   # a checkout of another commit

Each draw is one comparison of one metric: n paired differences from a distribution centred on 0 (normal, or
Student-t with 2 degrees of freedom), the baseline all zeros. Prints, per distribution and n, the share of draws with
a verdict other than inconclusive, and the bound alpha + 3 standard errors that tests/experiments/test_paired_test.py
holds the verdict to (that test runs the same check vectorised, at more n and draws). `--tree` imports podsrl from
another checkout, e.g. one from before the verdict became two-sided.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

DISTRIBUTIONS = {
    "normal": lambda rng, n: rng.normal(0.0, 1.0, n),
    "t2": lambda rng, n: rng.standard_t(2, n),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[5, 6, 8, 10, 12], help="numbers of pairs")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                        help="checkout whose podsrl to test (default: this one)")
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    from podsrl.experiments.stats import ALPHA, INCONCLUSIVE, paired_stat

    bound = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / args.draws)
    print(f"podsrl from {args.tree}; {args.draws} draws per row; bound {bound:.4f}")
    print("| differences | pairs | better | worse | any verdict |")
    print("|---|---|---|---|---|")
    for name, draw in DISTRIBUTIONS.items():
        for n in args.seeds:
            rng = np.random.default_rng(n)
            verdicts = [paired_stat("x", dict.fromkeys(range(n), 0.0), dict(enumerate(draw(rng, n)))).verdict
                        for _ in range(args.draws)]
            better, worse = verdicts.count("better") / args.draws, verdicts.count("worse") / args.draws
            rate = sum(v != INCONCLUSIVE for v in verdicts) / args.draws
            flag = "" if rate <= bound else " (above the bound)"
            print(f"| {name} | {n} | {better:.4f} | {worse:.4f} | {rate:.4f}{flag} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
