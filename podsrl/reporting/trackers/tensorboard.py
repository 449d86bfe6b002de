"""TensorBoard event files in <run dir>/tensorboard (the default tracker)."""

from __future__ import annotations

import json

from podsrl.reporting.trackers.base import TrackedRun, Tracker


class TensorBoard(Tracker):
    def __init__(self, run: TrackedRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: on resume, TensorBoard hides the events logged after the checkpoint step
        purge = run.resume_step + 1 if run.resumed else None
        self.writer = SummaryWriter(str(run.run_dir / "tensorboard"), purge_step=purge)
        if not run.resumed:
            self.writer.add_text("run_name", run.name, 0)
            self.writer.add_text("config", "```\n" + json.dumps(run.config, indent=1) + "\n```", 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()
