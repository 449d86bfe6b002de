"""Trackio (the optional extra `podsrl[trackio]`): local-first, stored in trackio's own directory."""

from __future__ import annotations

import os

from podsrl.extras import require
from podsrl.reporting.trackers.base import TrackedRun, Tracker


class Trackio(Tracker):
    def __init__(self, run: TrackedRun) -> None:
        require("trackio", "log.report_to: trackio")
        import trackio

        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", run.project), name=run.name,
                                config=run.config, resume="allow" if run.resumed else "never")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
