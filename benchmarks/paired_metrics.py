"""Paired-by-seed differences between two configs of a `podsrl compare` folder: final held-out metrics, and
per-step training metrics averaged over each run's steps (optionally only those after `--after-step`).

    python benchmarks/paired_metrics.py runs/results/knapsack grpo_clip5 knapsack --after-step 16 \
        --keys frac_reward_zero_std total/rollouts_generated

For each metric: the baseline and method values per seed, the mean paired difference (method − baseline) with its
std over seeds, and the interval, sign-flip p and verdict of `podsrl compare` (podsrl/experiments/stats.py: expanded
percentile bootstrap of the paired differences at the level the header names, the exact two-sided sign-flip test,
Holm-corrected across the metrics printed; docs/statistics.md). With 3 seeds the interval is the range of the three
differences (~75% for the median) and no p reaches 0.05 (all three agreeing: 0.25; the fewest seeds that can: 6). `step` counts
the steps a run took; `final/<key>` is the last step record's value (e.g. cumulative totals).

`--at step` (or any key of the eval records, e.g. `total/rollouts_generated`) adds the held-out metrics of both
runs of a pair at the same point: the smaller of the two runs' last values of that key, each run's metrics linearly
interpolated between its evals. With `step`, that compares the methods at equal updates, whatever a step cost.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from podsrl.experiments.paired_test import format_p, interval_label  # noqa: E402
from podsrl.experiments.stats import ALPHA, paired_family, paired_stat  # noqa: E402
from podsrl.reporting.tracking import read_metrics  # noqa: E402

FINAL = ("eval/accuracy", "eval/avg@4", "eval/pass@4")


def eval_curve(run_dir: Path, axis: str) -> tuple[list[float], dict[str, list[float]]]:
    """x = the eval records' `axis` values; y = each held-out metric at those points."""
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    return [float(r[axis]) for r in evals], {k: [r[k] for r in evals] for k in FINAL if k in evals[-1]}


def at_common_point(base_dir: Path, method_dir: Path, axis: str) -> tuple[dict[str, float], dict[str, float]]:
    """Both runs' held-out metrics at the smaller of their last `axis` values."""
    (xb, yb), (xm, ym) = eval_curve(base_dir, axis), eval_curve(method_dir, axis)
    x = min(xb[-1], xm[-1])
    label = f"{{}} at equal {axis}"
    return ({label.format(k): float(np.interp(x, xb, v)) for k, v in yb.items()} | {f"common {axis}": x},
            {label.format(k): float(np.interp(x, xm, v)) for k, v in ym.items()} | {f"common {axis}": x})


def run_values(run_dir: Path, keys: list[str], after_step: int) -> dict[str, float]:
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "reward" in r]
    out = {f"final {k}": evals[-1][k] for k in FINAL if k in evals[-1]}
    out["steps"] = float(len(steps))
    for key in keys:
        if key.startswith("final/"):
            out[key] = steps[-1][key[len("final/"):]]
            continue
        values = [r[key] for r in steps if r["step"] > after_step and key in r]
        if values:
            out[key] = statistics.mean(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("baseline")
    parser.add_argument("method")
    parser.add_argument("--keys", nargs="*", default=[])
    parser.add_argument("--after-step", type=int, default=0)
    parser.add_argument("--at", help="also compare held-out metrics at an equal value of this eval-record key "
                        "(e.g. step, total/rollouts_generated)")
    args = parser.parse_args()
    folder = Path(args.folder)
    seeds = sorted(int(p.name[4:]) for p in (folder / args.baseline).glob("seed*")
                   if (folder / args.method / p.name / "summary.json").exists() and (p / "summary.json").exists())
    base = {s: run_values(folder / args.baseline / f"seed{s}", args.keys, args.after_step) for s in seeds}
    meth = {s: run_values(folder / args.method / f"seed{s}", args.keys, args.after_step) for s in seeds}
    for s in seeds if args.at else []:
        at_base, at_meth = at_common_point(folder / args.baseline / f"seed{s}", folder / args.method / f"seed{s}",
                                           args.at)
        base[s].update(at_base)
        meth[s].update(at_meth)
    print(f"`{args.method}` − `{args.baseline}`, paired over seeds {seeds}; step metrics over steps > {args.after_step}")
    level = interval_label(len(seeds), ALPHA)
    print(f"| metric | baseline per seed | method per seed | mean diff ± std | interval ({level}) "
          "| sign-flip p (Holm) | verdict |")
    print("|---|---|---|---|---|---|---|")
    keys = [k for k in base[seeds[0]] if not k.startswith("common ")
            and all(k in base[s] and k in meth[s] for s in seeds)]
    family = paired_family({k: paired_stat(k, {s: base[s][k] for s in seeds}, {s: meth[s][k] for s in seeds})
                            for k in keys})
    for key in base[seeds[0]]:
        if not all(key in base[s] and key in meth[s] for s in seeds):
            continue
        if key.startswith("common "):  # the shared point itself, not a comparison
            print(f"| {key} | {' / '.join(f'{base[s][key]:.4g}' for s in seeds)} | (same) | | | | |")
            continue
        diffs = [meth[s][key] - base[s][key] for s in seeds]
        paired = family[key]
        lo, hi = (math.nan, math.nan) if paired.ci_low is None else (paired.ci_low, paired.ci_high)
        tested = "" if paired.p_value is None else f"{format_p(paired.p_value)} ({format_p(paired.p_holm)})"
        # a step metric has no good side: say higher / lower
        verdict = ("one seed: no verdict" if len(seeds) < 2 else
                   paired.words.replace("better", "higher").replace("worse", "lower"))
        spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        print(f"| {key} | {' / '.join(f'{base[s][key]:.4g}' for s in seeds)} | "
              f"{' / '.join(f'{meth[s][key]:.4g}' for s in seeds)} | {statistics.mean(diffs):+.4g} ± {spread:.2g} | "
              f"[{lo:+.4g}, {hi:+.4g}] | {tested} | {verdict} |")


if __name__ == "__main__":
    main()
