"""The per-run plot: training reward and held-out accuracy over steps and over training time (train.clock)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from podsrl.reporting.tracking import read_metrics  # noqa: E402


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if "reward" in r and r.get("reward") is not None]
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    config_path = run_dir / "config.yaml"
    config = (yaml.safe_load(config_path.read_text()) or {}) if config_path.is_file() else {}
    clock = "CPU time" if config.get("train", {}).get("clock") == "cpu" else "wall-clock"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if train:
        axes[0].plot([r["step"] for r in train], [r["reward"] for r in train], lw=1, label="train reward")
    axes[0].set(xlabel="step", ylabel="mean reward", title="Training reward")
    for ax, x_key, x_label in ((axes[1], "step", "step"), (axes[2], "time/elapsed", f"training {clock} (s)")):
        if evals:
            ax.plot([r[x_key] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="greedy pass@1")
            avg = [k for k in evals[-1] if k.startswith("eval/avg@")]
            if avg:
                ax.plot([r[x_key] for r in evals], [r.get(avg[0]) for r in evals], "s--", label=avg[0][5:])
        ax.set(xlabel=x_label, ylabel="held-out accuracy", title="Held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = out or run_dir / "plots.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
