"""Comparison machinery: curve maths, aggregation over seeds and report files (the runner: test_runner.py)."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from podsrl.errors import DataError, UserError
from podsrl.experiments.analysis import (
    compare_runs,
    load_run,
    plateau_accuracy,
    read_metrics,
    smooth,
    speedup,
    time_to_target,
)
from podsrl.experiments.plots import seed_band
from podsrl.experiments.report import (
    NOT_REACHED,
    add_report_arguments,
    build_report,
    discover_run_dirs,
    report_main,
)


def write_run(
    run_dir: Path,
    times,
    accs,
    seed: int | None = None,
    name: str | None = None,
    step_times=(1.0, 3.0),
    rollouts_per_step: int = 10,
    finished: bool = True,
) -> Path:
    """A run dir per the contract: eval records at steps 0..E-1, a step record before each later eval."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"seed": seed, "output_dir": str(run_dir)} | ({"name": name} if name else {})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    lines = []
    for step, (t, a) in enumerate(zip(times, accs)):
        totals = {
            "total/rollouts_generated": 4 * rollouts_per_step * step,
            "total/rollouts_trained": rollouts_per_step * step,
            "total/tokens_generated": 400 * step,
            "total/tokens_trained": 100 * step,
        }
        if step > 0:
            st_ = step_times[(step - 1) % len(step_times)]
            lines.append(
                {
                    "step": step,
                    "time/elapsed": t,
                    "reward": a,
                    "time/generate": st_,
                    "time/score": 0.1,
                    "time/select": 0.01,
                    "time/update": 0.5,
                    "time/step": st_ + 0.61,
                    "rollouts/generated": 4 * rollouts_per_step,
                    **totals,
                }
            )
        lines.append({"step": step, "time/elapsed": t, "eval/accuracy": a, "eval/avg@8": a / 2, **totals})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if finished:
        (run_dir / "summary.json").write_text(json.dumps({"steps": len(times) - 1}))
    return run_dir


# --- curve maths ---


def test_smooth_hand_values():
    assert smooth([0, 1, 2, 3], 1).tolist() == [0, 1, 2, 3]
    assert smooth([0, 1, 2, 3], 2).tolist() == [0, 0.5, 1.5, 2.5]
    assert np.allclose(smooth([3, 0, 3, 6], 3), [3, 1.5, 2, 3])
    assert np.allclose(smooth([1, 2, 3], 10), [1, 1.5, 2])  # window longer than the curve: running mean
    with pytest.raises(ValueError):
        smooth([1.0], 0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=30), st.integers(1, 8))
def test_smooth_matches_brute_force(values, w):
    brute = [np.mean(values[max(0, i - w + 1) : i + 1]) for i in range(len(values))]
    assert np.allclose(smooth(values, w), brute)


TIMES = [5.0, 10.0, 20.0, 30.0]
ACCS = [0.1, 0.3, 0.5, 0.6]


@pytest.mark.parametrize(
    ("target", "interpolated", "at_point"),
    [
        (0.4, 15.0, 20.0),  # mid-interval: halfway from 0.3 (t=10) to 0.5 (t=20)
        (0.5, 20.0, 20.0),  # exactly at an eval point
        (0.05, 5.0, 5.0),  # the first point already reaches it
        (0.1, 5.0, 5.0),
        (0.55, 25.0, 30.0),
        (0.7, None, None),  # never
    ],
)
def test_time_to_target(target, interpolated, at_point):
    def approx(x):
        return None if x is None else pytest.approx(x)

    assert time_to_target(TIMES, ACCS, target) == approx(interpolated)
    assert time_to_target(TIMES, ACCS, target, interpolate=False) == approx(at_point)


def test_time_to_target_uses_smoothed_curve_and_first_crossing():
    # smoothed (w=2): [0, .3, .6, .6, ...]; crossing 0.5 between t=10 (.3) and t=20 (.6)
    assert time_to_target([0, 10, 20, 30], [0, 0.6, 0.6, 0.6], 0.5, smooth_window=2) == pytest.approx(
        10 + 20 / 3
    )
    # the raw curve touches 0.6 at t=10; smoothed [0, .3, .3] never does, smoothed [0, .3, .75] at t=20
    assert time_to_target([0, 10, 20], [0.0, 0.6, 0.0], 0.6, smooth_window=2) is None
    assert time_to_target([0, 10, 20], [0.0, 0.6, 0.9], 0.6, smooth_window=2, interpolate=False) == 20
    # a dip after reaching: the first crossing counts; works with any x (rollouts)
    assert time_to_target([100, 200, 300], [0.2, 0.8, 0.1], 0.5) == pytest.approx(150)


def test_speedup():
    assert speedup(100.0, 50.0) == 2.0
    assert speedup(30.0, 45.0) == pytest.approx(2 / 3)
    assert speedup(None, 5.0) is None and speedup(5.0, None) is None and speedup(None, None) is None
    assert speedup(0.0, 0.0) == 1.0  # both met it with the starting model
    assert speedup(10.0, 0.0) is None  # undefined rather than infinite


def test_plateau_and_peak():
    acc = np.linspace(0.1, 1.0, 10)
    assert plateau_accuracy(acc, 0.2) == pytest.approx(0.95)
    assert plateau_accuracy(acc, 0.01) == pytest.approx(1.0)  # at least one point
    assert plateau_accuracy(acc, 1.0) == pytest.approx(0.55)


def test_read_metrics_drops_stale_records_after_resume(tmp_path):
    recs = [
        {"step": 0, "eval/accuracy": 0.1, "time/elapsed": 0},
        {"step": 1, "x": 1},
        {"step": 2, "x": 2},
        {"step": 2, "eval/accuracy": 0.2, "time/elapsed": 2},
        {"step": 3, "x": 3},
        {"step": 4, "x": 4},  # crashed here; the checkpoint was at step 2
        {"step": 2, "eval/accuracy": 0.25, "time/elapsed": 2},  # resumed run re-evaluates step 2
        {"step": 3, "x": 30},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "x"')  # torn last line
    got = read_metrics(path)
    assert [(r["step"], r.get("x"), r.get("eval/accuracy")) for r in got] == [
        (0, None, 0.1),
        (1, 1, None),
        (2, 2, None),
        (2, None, 0.25),
        (3, 30, None),
    ]
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl:2"):
        read_metrics(path)


def test_load_run(tmp_path):
    run = load_run(write_run(tmp_path / "pods" / "seed7", [0, 10, 20], [0.1, 0.2, 0.3], finished=False))
    assert (run.label, run.seed, run.finished, run.n_steps) == ("pods", 7, False, 2)
    assert run.eval_curve["total/tokens_trained"].tolist() == [0, 100, 200]
    assert run.eval_curve["eval/avg@8"].tolist() == pytest.approx([0.05, 0.1, 0.15])
    assert run.train_means["time/generate"] == 2.0 and run.train_means["time/step"] == pytest.approx(2.61)
    assert run.totals["total/rollouts_generated"] == 80 and run.totals["time/elapsed"] == 20
    named = load_run(write_run(tmp_path / "x", [0, 1], [0.1, 0.2], seed=3, name="grpo-n16"))
    assert (named.label, named.seed, named.finished) == ("grpo-n16", 3, True)
    with pytest.raises(DataError, match="no metrics.jsonl"):
        load_run(tmp_path)


# --- aggregation over seeds ---

BASE_T = [0, 10, 20, 30, 40]
GRPO = {1: [0.2, 0.3, 0.4, 0.5, 0.5], 2: [0.2, 0.4, 0.6, 0.5, 0.4]}  # peaks 0.5 (t=30), 0.6 (t=20)
PODS_T = [0, 5, 10, 15, 20]
PODS = {1: [0.2, 0.4, 0.5, 0.6, 0.6], 2: [0.2, 0.3, 0.5, 0.55, 0.58]}  # seed 2 never reaches 0.6
WEAK = {1: [0.1, 0.1, 0.2, 0.2, 0.2], 2: [0.1, 0.2, 0.2, 0.2, 0.2]}  # reaches no target


def make_runs(root: Path) -> list[Path]:
    dirs = []
    for seed in (1, 2):  # seed-major, as compare writes them
        dirs.append(write_run(root / "grpo" / f"seed{seed}", BASE_T, GRPO[seed], step_times=(2.0,)))
        dirs.append(write_run(root / "pods" / f"seed{seed}", PODS_T, PODS[seed], step_times=(1.0, 3.0)))
        dirs.append(write_run(root / "weak" / f"seed{seed}", BASE_T, WEAK[seed]))
    return dirs


def test_compare_runs_per_seed_target(tmp_path):
    comp = compare_runs([load_run(d) for d in make_runs(tmp_path)], smooth_window=1, plateau_fraction=0.4)
    grpo, pods, weak = comp.configs
    assert (comp.baseline, [c.label for c in comp.configs]) == ("grpo", ["grpo", "pods", "weak"])
    assert comp.target == pytest.approx(0.55)
    assert [r.time_to_target for r in grpo.runs] == [30.0, 20.0]  # each baseline seed reaches its own peak
    assert [r.speedup for r in grpo.runs] == [1.0, 1.0]
    assert grpo.peak.mean == pytest.approx(0.55) and grpo.peak.std == pytest.approx(math.sqrt(0.005))
    assert (grpo.peak.min, grpo.peak.max, grpo.peak.n) == (0.5, 0.6, 2)
    assert grpo.plateau.mean == pytest.approx((0.5 + 0.45) / 2)
    assert [r.time_to_target for r in pods.runs] == [10.0, None]
    assert [r.speedup for r in pods.runs] == [3.0, None]
    assert (pods.speedup.mean, pods.speedup.std, pods.speedup.n) == (3.0, None, 1)
    assert pods.time_to_target.n == 1 and pods.rollouts_to_target.mean == 80  # 40 generated per step × 2
    assert pods.peak.mean == pytest.approx(0.59)
    assert pods.step_times["time/generate"].mean == 2.0 and grpo.step_times["time/generate"].mean == 2.0
    assert grpo.totals["total/rollouts_generated"].mean == 160
    assert weak.time_to_target.n == 0 and weak.speedup.n == 0 and weak.speedup.mean is None


def test_compare_runs_mean_target_and_named_baseline(tmp_path):
    runs = [load_run(d) for d in make_runs(tmp_path)]
    comp = compare_runs(runs, smooth_window=1, target_mode="mean")
    grpo, pods, _ = comp.configs
    assert [r.target for r in grpo.runs] == [pytest.approx(0.55)] * 2
    assert grpo.runs[0].time_to_target is None  # below the mean peak
    assert grpo.runs[1].time_to_target == pytest.approx(17.5)  # 0.4@10 -> 0.6@20
    assert pods.runs[0].time_to_target == pytest.approx(12.5) and pods.runs[0].speedup is None
    assert pods.runs[1].time_to_target == pytest.approx(15.0)
    assert pods.runs[1].speedup == pytest.approx(17.5 / 15.0)
    comp2 = compare_runs(runs, baseline="pods", smooth_window=1)
    assert comp2.configs[0].label == "pods" and comp2.target == pytest.approx(0.59)
    with pytest.raises(UserError, match="baseline 'nope'"):
        compare_runs(runs, baseline="nope")
    with pytest.raises(DataError, match="two runs"):
        compare_runs(runs + [runs[0]])


def test_seed_band_interpolates_on_shared_range():
    grid, mean, low, high = seed_band(
        [np.array([0.0, 10.0]), np.array([0.0, 5.0, 8.0])], [np.array([0.0, 1.0]), np.array([1.0, 1.0, 1.0])]
    )
    assert grid[0] == 0 and grid[-1] == 8  # cut at the shortest seed
    assert np.allclose(mean, (grid / 10 + 1) / 2) and np.allclose(low, grid / 10) and np.allclose(high, 1)


# --- report ---


def test_build_report_writes_tables_and_plot(tmp_path):
    dirs = make_runs(tmp_path / "runs")
    rows = build_report(
        dirs, out_dir=tmp_path / "out", smooth_window=1, plateau_fraction=0.4, header="# Machine X"
    )
    by = {r["config"]: r for r in rows}
    assert by["pods"]["speedup_mean"] == 3.0 and by["pods"]["reached"] == "1/2"
    assert by["pods"]["time_to_target_s_mean"] == 10.0 and by["grpo"]["time_to_target_s_mean"] == 25.0
    assert by["weak"]["time_to_target_s_mean"] == NOT_REACHED and by["weak"]["speedup_mean"] == NOT_REACHED
    assert by["grpo"]["peak_mean"] == pytest.approx(0.55) and by["grpo"]["mean_time_generate_s"] == 2.0
    md = (tmp_path / "out" / "results.md").read_text()
    assert md.startswith("# Machine X")
    weak_line = next(line for line in md.splitlines() if line.startswith("| `weak` | 2"))
    assert NOT_REACHED in weak_line and "inf" not in weak_line
    assert "3.00×" in md and "(1/2 reached)" in md
    with (tmp_path / "out" / "results.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["config"] for r in csv_rows] == ["grpo", "pods", "weak"]
    assert csv_rows[2]["time_to_target_s_mean"] == NOT_REACHED and float(csv_rows[1]["speedup_mean"]) == 3.0
    with (tmp_path / "out" / "runs.csv").open() as f:
        per_run = {(r["config"], r["seed"]): r for r in csv.DictReader(f)}
    assert (
        per_run[("pods", "2")]["speedup"] == NOT_REACHED and float(per_run[("pods", "1")]["speedup"]) == 3.0
    )
    png = (tmp_path / "out" / "accuracy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_main_rebuilds_from_compare_folder(tmp_path, capsys):
    root = tmp_path / "cmp"
    make_runs(root)
    (root / "header.md").write_text("# podsrl compare\n- machine: test box\n")
    write_run(root / "pods" / ".seed1.stale1", [0, 1], [0.9, 0.9], seed=1)  # hidden: ignored
    assert len(discover_run_dirs([root])) == 6
    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    args = parser.parse_args([str(root), "--smooth", "1", "--plateau-fraction", "0.4", "--baseline", "grpo"])
    assert report_main(args) == 0
    md = (root / "results.md").read_text()
    assert "test box" in md and "Baseline: `grpo`" in md and (root / "accuracy.png").is_file()
    with pytest.raises(UserError, match="no such run directory"):
        discover_run_dirs([tmp_path / "missing"])


def test_report_names_the_training_clock(tmp_path):
    """Runs timed with train.clock=cpu are reported and plotted as CPU time, not wall-clock."""
    import yaml as _yaml

    from podsrl.experiments.analysis import compare_runs, load_run

    dirs = make_runs(tmp_path / "runs")
    runs = [load_run(d) for d in dirs]
    assert compare_runs(runs).clock == "wall-clock"
    for d in dirs:
        config = _yaml.safe_load((d / "config.yaml").read_text()) | {"train": {"clock": "cpu"}}
        (d / "config.yaml").write_text(_yaml.safe_dump(config))
    assert compare_runs([load_run(d) for d in dirs]).clock == "CPU time"
    build_report(dirs, out_dir=tmp_path / "out")
    md = (tmp_path / "out" / "results.md").read_text()
    assert "training CPU time (eval excluded)" in md and "wall-clock" not in md


def test_per_run_plot_labels_the_training_clock(tmp_path, monkeypatch):
    """plots.png's time axis says CPU time for a train.clock=cpu run (the label is what differs)."""
    import yaml as _yaml

    import podsrl.reporting.plotting as plotting

    run = write_run(tmp_path / "run", [0, 1, 2], [0.1, 0.2, 0.3], seed=1)
    labels = []
    real_set = plotting.plt.Axes.set

    def spy(ax, **kwargs):
        labels.append(kwargs.get("xlabel"))
        return real_set(ax, **kwargs)

    monkeypatch.setattr(plotting.plt.Axes, "set", spy)
    plotting.plot_run(run)
    assert "training wall-clock (s)" in labels
    (run / "config.yaml").write_text(_yaml.safe_dump({"seed": 1, "train": {"clock": "cpu"}}))
    labels.clear()
    plotting.plot_run(run)
    assert "training CPU time (s)" in labels
