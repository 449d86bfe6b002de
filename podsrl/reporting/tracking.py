"""Where metrics go and how progress is shown. The trainer emits dicts; this decides where they go.

Sinks: metrics.jsonl in the run dir (always: resume, `podsrl report` and plots read it) plus the trackers named in
`log.report_to` with TRL's names ('all' / 'none' too), each a class in the registry of reporting/trackers/, imported
only when asked for (wandb and trackio are optional extras); the run name and the whole config are logged to them.

Progress: a rich live display on a terminal; when stdout is a file (a cluster job's log) one plain line every
`log_every` steps or `log_every_seconds` seconds instead, flushed at once, so the log shows the run as it goes.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from podsrl.errors import ConfigError
from podsrl.fileio import write_text_atomic
from podsrl.options import to_dict
from podsrl.reporting.streams import PROGRESS, is_lost
from podsrl.reporting.trackers import TRACKERS, TrackedRun, Tracker, tracker_class

_ORDER = {"reward": 0, "train_acc": 1, "eval_acc": 2, "loss": 0, "val_acc": 1}  # progress fields, in this order


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; None reads back as "missing"
    return value


def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl; a torn last line (killed mid-write) is ignored."""
    records = []
    if not Path(path).is_file():
        return records
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def normalize_report_to(value: Any, tensorboard: bool = True) -> list[str]:
    """log.report_to as a list of tracker names: TRL's values ("all", "none", a name, or a list of names)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"log.report_to: expected a tracker name or a list of them, got {value!r}")
    if names in (["none"], []):
        names = []
    elif names == ["all"]:
        names = list(TRACKERS)
    for n in names:
        if n not in TRACKERS:
            raise ConfigError(f"log.report_to: unknown tracker {n!r} (choose from {', '.join(TRACKERS)}, all, none;"
                              " metrics.jsonl is always written)")
    if not tensorboard:
        names = [n for n in names if n != "tensorboard"]
    return list(dict.fromkeys(names))


def _numbers(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)}


class MetricsLogger:
    """metrics.jsonl plus the trackers of `report_to`. Records are dicts with a "step"."""

    def __init__(self, run_dir: Path, report_to: list[str] | tuple[str, ...] = ("tensorboard",),
                 resume_step: int | None = None, run_name: str = "", project: str = "podsrl",
                 config: dict | None = None) -> None:
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None:
            # Records written after the checkpoint we resume from will be produced again: drop them.
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            # A kill mid-rewrite must not lose the history.
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a", encoding="utf-8")
        run = TrackedRun(run_dir, run_name or run_dir.name, project, config or {}, resume_step)
        self._trackers: list[Tracker] = []
        try:
            for name in report_to:
                self._trackers.append(tracker_class(name)(run))
        except BaseException:
            self.close()
            raise

    def log(self, record: dict) -> None:
        record = {k: _clean(v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        values, step = _numbers(record), int(record.get("step", 0))
        for tracker in self._trackers:
            tracker.log(values, step)

    def close(self) -> None:
        self._file.close()
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StepProgress:
    """Progress of a loop of `total` steps: a rich live display when `stream` is a terminal, plain lines otherwise
    (one every `every_steps` steps or `every_seconds` seconds, and at the last step). Values passed to `update`
    (reward, acc, loss, ...) are remembered, so each line shows the latest of each. Silent when disabled (tests,
    compare's inner runs)."""

    def __init__(self, total: int, enabled: bool = True, start: int = 0, label: str = "train",
                 every_steps: int = 10, every_seconds: float = 60.0, stream: TextIO | None = None,
                 live: bool | None = None) -> None:
        self.enabled, self.total, self.label = enabled, total, label
        self.values: dict[str, float] = {}
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self._stream = stream or sys.stdout
        self._start_step, self._last_step, self._step = start, start, start
        self._t0 = self._last_time = time.monotonic()
        self._progress = None
        if not enabled:
            return
        if live if live is not None else self._stream.isatty():
            self._progress = Progress(
                TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
            )
            self._task = self._progress.add_task(label, total=total, completed=start, info="")
            self._progress.start()
        else:
            self._print(f"{label} start | step {start}/{total}")

    def _print(self, line: str) -> None:
        if not is_lost(self._stream):
            self._stream.write(line + "\n")
            self._stream.flush()
        if is_lost(self._stream):  # a closed pipe (podsrl/reporting/streams.py): run.log keeps the line
            PROGRESS.info(line)

    def _info(self) -> str:
        parts = [f"{k} {v:.3f}" for k, v in sorted(self.values.items(), key=lambda kv: _ORDER.get(kv[0], 99))
                 if k != "step_time"]
        if "step_time" in self.values:
            parts.append(f"{self.values['step_time']:.2f} s/step")
        return " | ".join(parts)

    def update(self, step: int, **values: float | None) -> None:
        self.values.update({k: float(v) for k, v in values.items() if v is not None})
        if not self.enabled:
            return
        self._step = step
        if self._progress is not None and is_lost(self._stream):  # the terminal is gone: plain lines to run.log
            self._progress.stop()
            self._progress = None
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=self._info().replace(" | ", "  "))
            return
        now = time.monotonic()
        due = (step - self._last_step >= self.every_steps or now - self._last_time >= self.every_seconds
               or (step >= self.total and step > self._last_step))
        if due:
            self._line(step, now)

    def _line(self, step: int, now: float) -> None:
        self._last_step, self._last_time = step, now
        done = step - self._start_step
        eta = (now - self._t0) / done * (self.total - step) if done > 0 else float("nan")
        info = self._info()
        self._print(f"{self.label} step {step}/{self.total}" + (f" | {info}" if info else "")
                    + f" | elapsed {_clock(now - self._t0)} | eta {_clock(eta)}")

    def close(self) -> None:
        """Stop the live display; in plain mode, print the last step reached if its line is still due (a loop
        that ends early, e.g. a warm-up reaching its target)."""
        if self._progress is not None:
            self._progress.stop()
        elif self.enabled and self._step > self._last_step:
            self._line(self._step, time.monotonic())


def build_metrics_logger(cfg: Any, run_dir: Path, resume_step: int | None) -> MetricsLogger:
    """The run's MetricsLogger from its config (log.report_to / run_name / project); the config is logged too,
    under its YAML keys."""
    name = cfg.log.run_name or f"{cfg.name or Path(run_dir).name}-seed{cfg.seed}"
    logging.getLogger("podsrl").info("run %s: metrics to %s%s", name, Path(run_dir) / "metrics.jsonl",
                                     "".join(f", {t}" for t in cfg.log.report_to))
    return MetricsLogger(run_dir, cfg.log.report_to, resume_step, name, cfg.log.project, to_dict(cfg))


def build_progress(cfg: Any, total: int, enabled: bool, start: int = 0, label: str = "train") -> StepProgress:
    return StepProgress(total, enabled and cfg.log.progress, start, label, cfg.log.log_every,
                        cfg.log.log_every_seconds)
