"""Read saved runs and turn their held-out curves into comparable numbers.

Conventions (the report states them too):
- Smoothing: trailing running mean over the last `w` eval points (fewer at the start). Trailing, not centred,
  so the smoothed value at an eval point uses only evals done by then: "time to target" is a time at which the
  run could have known it had arrived.
- Peak: max of the smoothed curve. Plateau: mean of the raw accuracy over the last `fraction` of eval points.
- Time to target: first x (wall-clock seconds by default) where the smoothed curve reaches the target. With
  `interpolate=True` (default) the crossing between the last point below and the first point at/above the
  target is linearly interpolated, which removes most of the eval-interval quantisation (methods whose steps
  last different times are evaluated at different wall-clock points). `None` means never reached.
- Speed-up = baseline time / method time (> 1: the method is faster).
- Final: the raw accuracy of the last eval point.
- Area under the accuracy-vs-time curve: the trapezoid integral of the raw accuracy over [0, T], divided by T
  (so it reads as a time-averaged accuracy). T is, per seed, the earliest end among the configs' runs of that
  seed: every run of a seed is integrated over the same wall-clock, which keeps the pairs like for like.
- Paired statistics of each config against the baseline: podsrl/experiments/stats.py.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from podsrl.errors import DataError, UserError
from podsrl.experiments.stats import PairedStat, paired_family, paired_stat

ACCURACY = "eval/accuracy"
TIME = "time/elapsed"
TOKENS_TRAINED = "total/tokens_trained"
ROLLOUTS_GENERATED = "total/rollouts_generated"
CURVE_KEYS = (
    "step",
    TIME,
    TOKENS_TRAINED,
    ROLLOUTS_GENERATED,
    "total/rollouts_trained",
    "total/tokens_generated",
    "total/tokens_environment",
)
STEP_TIME_KEYS = ("time/generate", "time/score", "time/select", "time/update", "time/step")
TOTAL_KEYS = (
    "total/rollouts_generated",
    "total/rollouts_trained",
    "total/tokens_generated",  # the model's tokens
    "total/tokens_environment",  # episodes: the environment's tokens (tool answers), apart
    "total/tokens_trained",
)
# Float slack so a curve whose value *is* the target (e.g. the baseline's own peak) counts as reaching it.
_REACH_TOL = 1e-12


def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl, with the stale records of a crashed attempt removed.

    A resumed run restarts from its last checkpoint, so steps logged after that checkpoint appear twice: once
    from the crashed attempt, once again. When a record's step is not past the largest step seen, earlier
    records of a later step, and of the same step and kind (eval/train), are dropped: the newest attempt wins.
    A truncated last line (a crash mid-write) is ignored; a bad line elsewhere is a DataError naming the line.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    kept: list[dict] = []
    max_step = -math.inf
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise DataError(f"{path}:{number}: not a JSON object ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            raise DataError(f"{path}:{number}: a metrics record needs a numeric 'step'")
        step, is_eval = record["step"], ACCURACY in record
        if step <= max_step:
            kept = [r for r in kept if r["step"] < step or (r["step"] == step and (ACCURACY in r) != is_eval)]
        kept.append(record)
        max_step = max(max_step, step)
    return kept


@dataclass
class RunRecord:
    """One saved run: its identity, eval curve (arrays sorted by step) and step-level means."""

    run_dir: Path
    label: str
    seed: int | None
    config: dict
    eval_curve: dict[str, np.ndarray]  # CURVE_KEYS and every eval/* key -> [E] float (nan where not logged)
    train_means: dict[str, float]  # mean over step records of each numeric per-step metric
    totals: dict[str, float]  # last logged value of each total/* key, and time/elapsed
    summary: dict | None  # summary.json, None while the run is unfinished
    n_steps: int = 0

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def name(self) -> str:
        return f"{self.label} seed{self.seed}" if self.seed is not None else self.label

    @property
    def times(self) -> np.ndarray:
        return self.eval_curve[TIME]

    @property
    def accuracy(self) -> np.ndarray:
        return self.eval_curve[ACCURACY]


def _label_and_seed(run_dir: Path, config: dict) -> tuple[str, int | None]:
    """Label: config `name`, else the parent dir of a `seed<k>` dir (compare's layout), else the dir name."""
    match = re.fullmatch(r"seed(-?\d+)", run_dir.name)
    seed = config.get("seed")
    if not isinstance(seed, int):
        seed = int(match.group(1)) if match else None
    name = config.get("name")
    if isinstance(name, str) and name:
        return name, seed
    return (run_dir.parent.name if match else run_dir.name), seed


def load_run(run_dir: str | Path, label: str | None = None) -> RunRecord:
    """Load config.yaml, metrics.jsonl and (if present) summary.json of one run dir."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise DataError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    config: dict = {}
    if (run_dir / "config.yaml").is_file():
        loaded = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        config = loaded if isinstance(loaded, dict) else {}
    summary = None
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    records = read_metrics(metrics_path)
    evals = sorted((r for r in records if ACCURACY in r), key=lambda r: r["step"])
    if not evals:
        raise DataError(f"{metrics_path}: no eval records (with '{ACCURACY}')")
    if any(not isinstance(r.get(TIME), (int, float)) for r in evals):
        raise DataError(f"{metrics_path}: every eval record needs a numeric '{TIME}'")
    keys = list(CURVE_KEYS) + sorted({k for r in evals for k in r if k.startswith("eval/")})
    curve = {k: np.array([float(r.get(k, math.nan)) for r in evals], dtype=float) for k in keys}

    steps = [r for r in records if ACCURACY not in r]
    sums: dict[str, list[float]] = {}
    for r in steps:
        for k, v in r.items():
            numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
            if numeric and k not in ("step", TIME) and not k.startswith("total/"):
                sums.setdefault(k, []).append(float(v))
    train_means = {k: float(np.mean(v)) for k, v in sums.items()}
    totals: dict[str, float] = {}
    for r in records:  # in file order: the last value logged wins
        for k in (*TOTAL_KEYS, TIME):
            if isinstance(r.get(k), (int, float)):
                totals[k] = float(r[k])
    run_label, seed = _label_and_seed(run_dir, config)
    return RunRecord(
        run_dir=run_dir,
        label=label or run_label,
        seed=seed,
        config=config,
        eval_curve=curve,
        train_means=train_means,
        totals=totals,
        summary=summary,
        n_steps=len({r["step"] for r in steps}),
    )


def smooth(values: Sequence[float] | np.ndarray, window: int) -> np.ndarray:
    """Trailing running mean: out[i] = mean(values[max(0, i-window+1) : i+1])."""
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {window}")
    v = np.asarray(values, dtype=float)
    if len(v) == 0:
        return v
    # Sum each window directly (not as a difference of cumulative sums): window 1 returns the values exactly.
    padded = np.concatenate([np.zeros(window - 1), v])
    sums = np.lib.stride_tricks.sliding_window_view(padded, window).sum(axis=1)
    return sums / np.minimum(np.arange(1, len(v) + 1), window)


def time_to_target(
    times: Sequence[float] | np.ndarray,
    accuracies: Sequence[float] | np.ndarray,
    target: float,
    smooth_window: int = 1,
    interpolate: bool = True,
) -> float | None:
    """First x where the smoothed curve reaches `target`, None if never; x may be times or e.g. rollouts."""
    t = np.asarray(times, dtype=float)
    acc = smooth(accuracies, smooth_window)
    if len(t) != len(acc):
        raise ValueError(f"{len(t)} times but {len(acc)} accuracies")
    hit = np.flatnonzero(acc >= target - _REACH_TOL)
    if len(hit) == 0:
        return None
    i = int(hit[0])
    if i == 0 or not interpolate:
        return float(t[i])
    a0, a1 = acc[i - 1], acc[i]
    frac = min(1.0, max(0.0, (target - a0) / (a1 - a0)))
    return float(t[i - 1] + frac * (t[i] - t[i - 1]))


def speedup(baseline_time: float | None, method_time: float | None) -> float | None:
    """baseline_time / method_time; None when either never reached the target.

    A method time of 0 means the target was met by the starting model: the ratio is 1 if the baseline also met
    it at 0 and undefined (None) otherwise, rather than an infinite speed-up.
    """
    if baseline_time is None or method_time is None:
        return None
    if method_time <= 0:
        return 1.0 if baseline_time <= 0 else None
    return baseline_time / method_time


def peak_accuracy(accuracies: Sequence[float] | np.ndarray, smooth_window: int = 1) -> float:
    return float(np.max(smooth(accuracies, smooth_window)))


def area_under_curve(
    times: Sequence[float] | np.ndarray, accuracies: Sequence[float] | np.ndarray, horizon: float
) -> float:
    """Trapezoid integral of accuracy over [times[0], horizon] divided by its length (linear in-between).

    The curve is cut at `horizon` by linear interpolation; a horizon at or before the first eval point gives
    the first accuracy.
    """
    t, acc = np.asarray(times, dtype=float), np.asarray(accuracies, dtype=float)
    if len(t) != len(acc) or len(t) == 0:
        raise ValueError(f"need as many times as accuracies (>= 1), got {len(t)} and {len(acc)}")
    if horizon <= t[0]:
        return float(acc[0])
    inside = t < horizon
    xs = np.append(t[inside], horizon)
    ys = np.append(acc[inside], np.interp(horizon, t, acc))
    area = float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2))
    return area / (horizon - t[0])


def plateau_accuracy(accuracies: Sequence[float] | np.ndarray, fraction: float = 0.2) -> float:
    """Mean of the raw accuracy over the last `fraction` of eval points (at least one point)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"plateau fraction must be in (0, 1], got {fraction}")
    acc = np.asarray(accuracies, dtype=float)
    k = max(1, math.ceil(fraction * len(acc) - 1e-9))
    return float(np.mean(acc[-k:]))


@dataclass(frozen=True)
class Spread:
    """Mean, sample std (ddof=1; None for one value) and range over seeds of the values that exist."""

    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Spread:
        v = np.array([x for x in values if x is not None and not math.isnan(x)], dtype=float)
        if len(v) == 0:
            return cls(None, None, None, None, 0)
        std = float(np.std(v, ddof=1)) if len(v) > 1 else None
        return cls(float(v.mean()), std, float(v.min()), float(v.max()), len(v))


@dataclass
class RunResult:
    """Numbers for one run against the comparison's target."""

    record: RunRecord
    final: float
    peak: float
    plateau: float
    auc: float  # time-averaged accuracy over the seed's common horizon (see the module docstring)
    horizon: float
    target: float
    time_to_target: float | None
    rollouts_to_target: float | None
    speedup: float | None = None


@dataclass
class ConfigSummary:
    """One config's runs aggregated over seeds."""

    label: str
    runs: list[RunResult]
    peak: Spread
    plateau: Spread
    time_to_target: Spread  # over the seeds that reached it; .n of len(runs)
    rollouts_to_target: Spread
    speedup: Spread  # over seeds paired with a baseline seed where both reached the target
    totals: dict[str, Spread] = field(default_factory=dict)  # total/* and time/elapsed
    step_times: dict[str, Spread] = field(default_factory=dict)  # STEP_TIME_KEYS
    paired: dict[str, PairedStat] = field(default_factory=dict)  # PAIRED_METRICS vs the baseline; {} for it

    @property
    def seeds(self) -> list[int | None]:
        return [r.record.seed for r in self.runs]


# metric name -> (RunResult attribute, higher is better); the paired statistics' metrics, in report order
PAIRED_METRICS: dict[str, tuple[str, bool]] = {
    "final": ("final", True),
    "peak": ("peak", True),
    "plateau": ("plateau", True),
    "auc": ("auc", True),
    "time_to_target": ("time_to_target", False),
}

PAIRED_TITLES = {
    "final": "final acc",
    "peak": "peak acc",
    "plateau": "plateau acc",
    "auc": "area under acc-vs-time / T",
    "time_to_target": "time to target (s)",
}


@dataclass
class Comparison:
    baseline: str
    target_mode: str
    target: float  # mean target (per_seed: mean of the baseline seeds' peaks)
    smooth_window: int
    plateau_fraction: float
    interpolate: bool
    configs: list[ConfigSummary]
    expect: str | None = None  # the side named before the runs (one-sided tests), else None (two-sided)

    @property
    def clock(self) -> str:
        """What time/elapsed counted in these runs (train.clock): 'wall-clock', 'CPU time' or both."""
        clocks = {r.record.config.get("train", {}).get("clock", "wall") for c in self.configs for r in c.runs}
        return {frozenset({"cpu"}): "CPU time"}.get(frozenset(clocks), "wall-clock" if clocks <= {"wall"}
                                                    else "clock (mixed wall-clock and CPU time)")


def group_runs(runs: Iterable[RunRecord]) -> dict[str, list[RunRecord]]:
    """label -> runs sorted by seed, labels in first-seen order; the same (label, seed) twice is an error."""
    groups: dict[str, list[RunRecord]] = {}
    for run in runs:
        same = [r for r in groups.setdefault(run.label, []) if r.seed == run.seed]
        if same:
            raise DataError(f"two runs of {run.name!r}: {same[0].run_dir} and {run.run_dir}; pass only one")
        groups[run.label].append(run)
    for members in groups.values():
        members.sort(key=lambda r: (r.seed is None, r.seed or 0))
    return groups


def compare_runs(
    runs: Iterable[RunRecord],
    baseline: str | None = None,
    smooth_window: int = 3,
    plateau_fraction: float = 0.2,
    target_mode: str = "per_seed",
    interpolate: bool = True,
    expect: str | None = None,
) -> Comparison:
    """Aggregate runs per config against the baseline's peak.

    target_mode "per_seed" (default): seed s of every config is timed to baseline seed s's smoothed peak, and
    the speed-up pairs the two; the baseline always reaches its own peak, so its speed-ups are 1 and a
    method's speed-up is a like-for-like ratio. Seeds the baseline lacks are timed to the mean baseline peak
    and get no speed-up.
    target_mode "mean": one target for all, the mean over baseline seeds of their smoothed peaks (the paper's
    "baseline's peak" on an averaged curve); baseline seeds below that mean then never reach it.
    expect: "better" or "worse" when that side was named before the runs (one-sided tests; stats.paired_stat).
    """
    if target_mode not in ("per_seed", "mean"):
        raise UserError(f"target mode must be 'per_seed' or 'mean', got {target_mode!r}")
    if smooth_window < 1 or not 0 < plateau_fraction <= 1:
        raise UserError(
            f"need smoothing window >= 1 and plateau fraction in (0, 1], got {smooth_window}, "
            f"{plateau_fraction}"
        )
    groups = group_runs(runs)
    if not groups:
        raise UserError("no runs to compare")
    baseline = baseline if baseline is not None else next(iter(groups))
    if baseline not in groups:
        raise UserError(f"baseline {baseline!r} is not among the configs: {', '.join(groups)}")
    order = [baseline] + [k for k in groups if k != baseline]
    base_peaks = {r.seed: peak_accuracy(r.accuracy, smooth_window) for r in groups[baseline]}
    mean_target = float(np.mean(list(base_peaks.values())))
    horizons: dict[int | None, float] = {}  # per seed: the earliest end of a run of that seed
    for label in order:
        for r in groups[label]:
            horizons[r.seed] = min(horizons.get(r.seed, math.inf), float(r.times[-1]))

    results: dict[str, list[RunResult]] = {}
    for label in order:
        results[label] = []
        for r in groups[label]:
            target = base_peaks.get(r.seed, mean_target) if target_mode == "per_seed" else mean_target
            rollouts = r.eval_curve[ROLLOUTS_GENERATED]
            results[label].append(
                RunResult(
                    record=r,
                    final=float(r.accuracy[-1]),
                    peak=peak_accuracy(r.accuracy, smooth_window),
                    plateau=plateau_accuracy(r.accuracy, plateau_fraction),
                    auc=area_under_curve(r.times, r.accuracy, horizons[r.seed]),
                    horizon=horizons[r.seed],
                    target=target,
                    time_to_target=time_to_target(r.times, r.accuracy, target, smooth_window, interpolate),
                    rollouts_to_target=None
                    if np.isnan(rollouts).any()
                    else time_to_target(rollouts, r.accuracy, target, smooth_window, interpolate),
                )
            )
    base_times = {res.record.seed: res.time_to_target for res in results[baseline]}
    configs = []
    for label in order:
        runs_l = results[label]
        for res in runs_l:
            if res.record.seed in base_times:
                res.speedup = speedup(base_times[res.record.seed], res.time_to_target)
        keys = sorted({k for res in runs_l for k in res.record.totals})
        configs.append(
            ConfigSummary(
                label=label,
                runs=runs_l,
                peak=Spread.of(x.peak for x in runs_l),
                plateau=Spread.of(x.plateau for x in runs_l),
                time_to_target=Spread.of(x.time_to_target for x in runs_l),
                rollouts_to_target=Spread.of(x.rollouts_to_target for x in runs_l),
                speedup=Spread.of(x.speedup for x in runs_l),
                totals={k: Spread.of(x.record.totals.get(k) for x in runs_l) for k in keys},
                step_times={
                    k: Spread.of(x.record.train_means.get(k) for x in runs_l) for k in STEP_TIME_KEYS
                },
                paired={} if label == baseline else paired_metrics(results[baseline], runs_l, expect),
            )
        )
    return Comparison(
        baseline, target_mode, mean_target, smooth_window, plateau_fraction, interpolate, configs, expect
    )


def paired_metrics(
    baseline: list[RunResult], method: list[RunResult], expect: str | None = None
) -> dict[str, PairedStat]:
    """PAIRED_METRICS of `method` against `baseline`, paired by seed, Holm-corrected across the metrics."""
    out = {}
    for metric, (attr, higher_is_better) in PAIRED_METRICS.items():
        base = {r.record.seed: getattr(r, attr) for r in baseline}
        values = {r.record.seed: getattr(r, attr) for r in method}
        out[metric] = paired_stat(metric, base, values, higher_is_better, expect)
    return paired_family(out)
