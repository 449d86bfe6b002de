"""One run directory's outcome in a few lines: steps done, the training clock and mean step time, the means over
the steps of the rollout-correction metrics (sampling/*: sampler vs trainer log-prob gap, importance ratios, the
share masked or truncated), the first and last eval records.

    python benchmarks/run_summary.py runs/default
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from podsrl.reporting.tracking import read_metrics


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else float("nan")


def summary(run_dir: Path) -> list[str]:
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "reward" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    lines = [f"run {run_dir}: {len(steps)} training steps, {len(evals)} eval records"]
    if steps:
        last = steps[-1]
        lines.append(f"last step {last['step']}: time/elapsed {last.get('time/elapsed', float('nan')):.1f} s, "
                     f"reward {last['reward']:.3f}, mean time/step {_mean(steps, 'time/step'):.3f} s")
        sampling = sorted({k for r in steps for k in r if k.startswith("sampling/")})
        if sampling:
            lines.append("sampling, mean over steps: " + ", ".join(f"{k} {_mean(steps, k):.4g}" for k in sampling))
    named = ([("first", evals[0])] if len(evals) > 1 else []) + [("last", e) for e in evals[-1:]]
    for name, r in named:
        lines.append(f"{name} eval: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in r.items() if k.startswith(("step", "eval/", "time/"))))
    return lines


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1]))))
