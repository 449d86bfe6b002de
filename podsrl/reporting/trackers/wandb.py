"""Weights & Biases (the optional extra `podsrl[wandb]`): one wandb run per podsrl run, continued on resume."""

from __future__ import annotations

import os

from podsrl.extras import require
from podsrl.reporting.trackers.base import TrackedRun, Tracker


class Wandb(Tracker):
    def __init__(self, run: TrackedRun) -> None:
        require("wandb", "log.report_to: wandb")
        import wandb

        # an absolute dir: a shared wandb-core service (WANDB_SERVICE) resolves relative paths against its own cwd
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", run.project), name=run.name, config=run.config,
                              dir=str(run.run_dir.resolve()), id=run.tracker_id("wandb"), resume="allow")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
