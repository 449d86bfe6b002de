"""Metric sinks (JSONL, TensorBoard) and the progress bar. The trainer emits dicts; this decides where they go."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from podsrl.fileio import write_text_atomic


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


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None:
            # Records written after the checkpoint we resume from will be produced again: drop them.
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            # A kill mid-rewrite must not lose the history.
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: on resume, TensorBoard hides the events logged after the checkpoint step
                purge = resume_step + 1 if resume_step is not None else None
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=purge)
            except ImportError:
                self._tb = None

    def log(self, record: dict) -> None:
        record = {k: _clean(v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record.get("step", 0))
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class StepProgress:
    """A rich bar: step, reward, held-out accuracy, step time. Silent when disabled (tests, compare's inner runs)."""

    def __init__(self, total: int, enabled: bool = True, start: int = 0) -> None:
        self.enabled = enabled
        self.reward = self.accuracy = self.step_time = float("nan")
        if not enabled:
            return
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
        )
        self._task = self._progress.add_task("train", total=total, completed=start, info="")
        self._progress.start()

    def update(self, step: int, reward: float | None = None, accuracy: float | None = None,
               step_time: float | None = None) -> None:
        if reward is not None:
            self.reward = reward
        if accuracy is not None:
            self.accuracy = accuracy
        if step_time is not None:
            self.step_time = step_time
        if self.enabled:
            info = f"reward {self.reward:.3f}  acc {self.accuracy:.3f}  {self.step_time:.2f}s/step"
            self._progress.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if self.enabled:
            self._progress.stop()
