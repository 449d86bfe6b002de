"""Final held-out metrics (greedy accuracy, Avg@k, pass@k) per config of a `podsrl compare` folder, mean over seeds.

    python benchmarks/final_eval_table.py runs/results/aero
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from podsrl.reporting.tracking import read_metrics  # noqa: E402


def main(folder: str) -> None:
    rows = {}
    for summary in sorted(Path(folder).glob("*/seed*/summary.json")):
        evals = [r for r in read_metrics(summary.parent / "metrics.jsonl") if "eval/accuracy" in r]
        rows.setdefault(summary.parent.parent.name, []).append(evals[-1])
    keys = sorted({k for runs in rows.values() for k in runs[0] if k.startswith(("eval/avg@", "eval/pass@"))})
    print("| config | seeds | final greedy acc | " + " | ".join(f"final {k[5:]}" for k in keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for name, runs in rows.items():
        cells = [f"{statistics.mean(r[k] for r in runs):.3f}" for k in ["eval/accuracy", *keys]]
        print(f"| `{name}` | {len(runs)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
