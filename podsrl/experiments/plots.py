"""Held-out accuracy against wall-clock and against tokens trained, one colour per config, seeds as a band."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib import rcParams
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from podsrl.experiments.analysis import PAIRED_TITLES, TIME, TOKENS_TRAINED, Comparison, smooth
from podsrl.experiments.stats import PairedStat

_GRID_POINTS = 200


def seed_band(
    xs: list[np.ndarray], ys: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Mean, min and max over seeds on a shared x grid, or None when no seed has usable points.

    Each seed's curve is linearly interpolated onto a grid from the latest first x to the earliest last x, so
    every grid point averages all seeds (seeds run to slightly different ends; the tails past the shortest are
    cut rather than averaged over fewer seeds, which would make the mean line jump).
    """
    pairs = []
    for x, y in zip(xs, ys):
        ok = ~(np.isnan(x) | np.isnan(y))
        if ok.any():
            order = np.argsort(x[ok], kind="stable")
            pairs.append((x[ok][order], y[ok][order]))
    if not pairs:
        return None
    lo, hi = max(p[0][0] for p in pairs), min(p[0][-1] for p in pairs)
    grid = np.linspace(lo, hi, _GRID_POINTS) if hi > lo else np.array([lo])
    stacked = np.stack([np.interp(grid, x, y) for x, y in pairs])  # [seeds, grid]
    return grid, stacked.mean(0), stacked.min(0), stacked.max(0)


def paired_legend(cfg_paired: dict[str, PairedStat], metric: str = "auc", baseline: str = "baseline") -> str:
    """One line for a plot legend: the config's paired difference and verdict on `metric` ('' for the baseline)."""
    p = cfg_paired.get(metric)
    return "" if p is None else f"{PAIRED_TITLES[metric]} vs {baseline}: {p.short()}"


def plot_comparison(comparison: Comparison, path: str | Path, title: str | None = None) -> Path:
    """Write a two-panel PNG: smoothed held-out accuracy vs training wall-clock and vs tokens trained."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A bare Figure on the Agg canvas: no pyplot, hence no global backend switch and no GUI anywhere.
    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    panels = ((TIME, f"training {comparison.clock} (s, excluding eval)"), (TOKENS_TRAINED, "tokens trained"))
    w = comparison.smooth_window
    for ax, (x_key, x_label) in zip(axes, panels):
        drawn = False
        for i, cfg in enumerate(comparison.configs):
            color = colors[i % len(colors)]
            xs = [r.record.eval_curve[x_key] for r in cfg.runs]
            ys = [smooth(r.record.accuracy, w) for r in cfg.runs]
            band = seed_band(xs, ys)
            if band is None:
                continue
            grid, mean, low, high = band
            label = f"{cfg.label} ({len(cfg.runs)} seed{'s' if len(cfg.runs) != 1 else ''})"
            # The paired verdicts vs the baseline, so the figure carries its own evidence.
            label += "".join(
                f"\n  {paired_legend(cfg.paired, m, comparison.baseline)}" for m in ("auc", "final") if m in cfg.paired
            )
            if len(grid) == 1:
                ax.plot(grid, mean, "o", color=color, label=label)
            else:
                ax.plot(grid, mean, color=color, linewidth=2, label=label)
                if len(cfg.runs) > 1:
                    ax.fill_between(grid, low, high, color=color, alpha=0.2, linewidth=0)
            drawn = True
        ax.axhline(
            comparison.target,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"{comparison.baseline} peak, mean over seeds ({comparison.target:.3f})",
        )
        if not drawn:
            ax.text(0.5, 0.5, f"no '{x_key}' logged", transform=ax.transAxes, ha="center", va="center")
        ax.set_xlabel(x_label)
        ax.set_ylabel("held-out accuracy (greedy pass@1)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(
        title
        or f"Held-out accuracy, smoothed over {w} eval{'s' if w != 1 else ''}; "
        "line = mean over seeds, band = min-max"
    )
    fig.savefig(path, dpi=120)
    return path
