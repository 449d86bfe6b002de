"""What a validated config means for this run, resolved once when the run starts and handed to what needs it: the
dtypes on the training device, whether generation runs ahead of the learner and the rollout-correction mode. The
config itself stays as loaded. (The rollouts per prompt the update trains have one resolution,
Method.trained_per_prompt; the number of processes is the distributed context's.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from podsrl.algo.rollout_correction import mismatch_kinds, resolve_rollout_correction
from podsrl.methods import METHODS
from podsrl.models.precision import resolve_compute_dtype
from podsrl.options import to_dict

if TYPE_CHECKING:
    from podsrl.config import Config


@dataclass(frozen=True)
class RunFacts:
    device: torch.device  # this process's training device
    master_dtype: torch.dtype  # parameters and optimiser state (model.dtype)
    compute_dtype: torch.dtype  # forward/backward matmuls on `device` (model.compute_dtype, `auto` resolved)
    overlap: bool  # generation runs ahead of the learner (train.async with max_staleness > 0)
    rollout_correction: str  # the mode algo.rollout_correction means here (`auto` resolved)
    mismatch: tuple[str, ...]  # how the sampler's log-probs differ from the trainer's (rollout_correction.py)


def run_facts(cfg: Config, device: torch.device) -> RunFacts:
    return RunFacts(
        device=device, master_dtype=getattr(torch, cfg.model.dtype),
        compute_dtype=resolve_compute_dtype(cfg, device),
        overlap=cfg.train.asynchronous.runs_ahead,
        rollout_correction=resolve_rollout_correction(cfg, device), mismatch=mismatch_kinds(cfg, device))


def unread_settings(cfg: Config) -> list[str]:
    """Dotted keys set away from their defaults in the sections of methods other than the chosen one: nothing in
    the run reads them (a method reads only its own section)."""
    keys = []
    for name, method in METHODS.items():
        if name == cfg.method or method.section is None:
            continue
        default, given = to_dict(method.section()), to_dict(getattr(cfg, name))
        keys.extend(f"{name}.{key}" for key, value in given.items() if value != default.get(key))
    return keys
