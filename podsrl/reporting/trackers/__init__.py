"""Trackers: where a run's metrics go beside metrics.jsonl, named in `log.report_to` (TRL's names). This registry
maps a name to its class (a `Tracker`, base.py), imported only when a run asks for it, so the optional extras (wandb,
trackio) stay optional. It is the one list of tracker names: the config's help for log.report_to, its check and
`all` read it. Adding a tracker: one module here and one line below (docs/architecture.md, "How to add a tracker")."""

from __future__ import annotations

import importlib

from podsrl.reporting.trackers.base import TrackedRun, Tracker

# name -> "module:class", imported on first use
TRACKERS: dict[str, str] = {
    "tensorboard": "podsrl.reporting.trackers.tensorboard:TensorBoard",
    "wandb": "podsrl.reporting.trackers.wandb:Wandb",
    "trackio": "podsrl.reporting.trackers.trackio:Trackio",
}


def tracker_class(name: str) -> type[Tracker]:
    """The class registered for the tracker `name` (a name normalize_report_to has accepted)."""
    module, _, cls = TRACKERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["TRACKERS", "TrackedRun", "Tracker", "tracker_class"]
