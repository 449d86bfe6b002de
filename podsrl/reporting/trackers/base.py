"""The tracker contract: what a tracker is given (`TrackedRun`) and what it does (`Tracker`: log numbers at a step,
close). MetricsLogger (reporting/tracking.py) builds one per name in log.report_to and hands it every record."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from podsrl.fileio import write_text_atomic


@dataclass(frozen=True)
class TrackedRun:
    """The run as a tracker sees it."""

    run_dir: Path
    name: str  # log.run_name, or the config name and seed
    project: str  # log.project
    config: dict  # the whole config under its YAML keys
    resume_step: int | None  # the checkpoint step a resumed run continues from (None: a fresh run)

    @property
    def resumed(self) -> bool:
        return self.resume_step is not None

    def tracker_id(self, tracker: str) -> str:
        """A run id kept in the run dir, so a resumed run continues the same tracker run (a fresh run gets a new
        one)."""
        path = self.run_dir / f".{tracker}_id"
        if self.resumed and path.is_file():
            return path.read_text(encoding="utf-8").strip()
        run_id = os.urandom(6).hex()
        write_text_atomic(path, run_id)
        return run_id


class Tracker:
    """One sink of a run's metrics. The constructor takes the TrackedRun (and opens the tracker's run: a resumed
    run continues its own where the tracker can); `log` gets each record's finite numbers, `close` ends the run."""

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and end the tracker's run; nothing to do by default."""
