"""Per-step training metrics of a `podsrl compare` folder, averaged per config: the mean over each run's steps
(optionally only those after `--after-step`), then mean ± std over seeds. Used for the gradient-noise and allocation
figures of the DynaMO comparison.

    python benchmarks/step_metric_means.py runs/results/dynamo --after-step 16 \
        --keys grad/noise_var grad/signal grad/noise_to_signal alloc/n_min alloc/n_max alloc/frac_budget_mastered
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from podsrl.reporting.tracking import read_metrics  # noqa: E402


def run_means(metrics_path: Path, keys: list[str], after_step: int) -> dict[str, float]:
    steps = [r for r in read_metrics(metrics_path) if "reward" in r and r["step"] > after_step]
    return {k: statistics.mean(values) for k in keys if (values := [r[k] for r in steps if k in r])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--keys", nargs="+", required=True)
    parser.add_argument("--after-step", type=int, default=0, help="ignore steps up to this one (e.g. a first epoch)")
    args = parser.parse_args()
    per_config: dict[str, list[dict[str, float]]] = {}
    for summary in sorted(Path(args.folder).glob("*/seed*/summary.json")):
        means = run_means(summary.parent / "metrics.jsonl", args.keys, args.after_step)
        per_config.setdefault(summary.parent.parent.name, []).append(means)
    print(f"steps > {args.after_step}; mean over steps per run, then mean ± std over seeds")
    print("| config | seeds | " + " | ".join(args.keys) + " |")
    print("|---|---|" + "---|" * len(args.keys))
    for name, runs in per_config.items():
        cells = []
        for k in args.keys:
            values = [r[k] for r in runs if k in r]
            spread = f" ± {statistics.stdev(values):.3g}" if len(values) > 1 else ""
            cells.append(f"{statistics.mean(values):.3g}{spread}" if values else "—")
        print(f"| `{name}` | {len(runs)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
