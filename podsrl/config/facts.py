"""What a validated config means for this run, resolved once when the run starts and handed to what needs it: the
dtypes on the training device, whether generation runs ahead of the learner and the rollout-correction mode. The
config itself stays as loaded. (The rollouts per prompt the update trains have one resolution,
Method.trained_per_prompt; the number of processes is the distributed context's.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from podsrl.algo.rollout_correction import TRL_DEFAULT_MODE
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
    # the engine's unsharded copy of the policy under FSDP: where it lives (the engine's, else `device`) and its dtype
    # (the compute dtype resolved there: float32 for the Ray pool's CPU copy)
    generation_device: torch.device
    generation_dtype: torch.dtype
    overlap: bool  # generation runs ahead of the learner (train.async with max_staleness > 0)
    rollout_correction: str  # the mode algo.rollout_correction means here (`auto` resolved)
    mismatch: tuple[str, ...]  # how the sampler's log-probs differ from the trainer's (rollout_correction.py)


def run_facts(cfg: Config, device: torch.device) -> RunFacts:
    compute = resolve_compute_dtype(cfg, device)  # the one resolution of the compute dtype for this run's device
    mismatch = mismatch_kinds(cfg, compute)
    elsewhere = generation_device(cfg)
    return RunFacts(
        device=device, master_dtype=getattr(torch, cfg.model.dtype), compute_dtype=compute,
        generation_device=elsewhere or device,
        generation_dtype=compute if elsewhere is None else resolve_compute_dtype(cfg, elsewhere),
        overlap=cfg.train.asynchronous.runs_ahead,
        rollout_correction=resolve_rollout_correction(cfg, mismatch), mismatch=mismatch)


def generation_device(cfg: Config) -> torch.device | None:
    """Where the engine's unsharded copy of the policy lives under FSDP (its `generation_device`; None: the run's
    device)."""
    device = cfg.rollout.engine_type.generation_device
    return torch.device(device) if device is not None else None


PRECISION_MODE = "token_tis"  # `auto`'s mode for a sampler that differs from the trainer in precision alone


def mismatch_kinds(cfg, compute_dtype: torch.dtype) -> tuple[str, ...]:
    """How the sampler's log-probs differ from the trainer's in this run: "engine" (an engine with kernels of its
    own, vLLM's), "staleness" (train.async samples from weights up to max_staleness steps old), "precision" (the
    update computes in `compute_dtype`, the run's resolved compute dtype, narrower than the trained parameters; the
    fast engine samples from a copy in that dtype); empty when the sampler is the trained module in its own
    precision (every other engine): the ratio is 1 up to float rounding."""
    kinds = {
        "engine": cfg.rollout.engine_type.own_kernels,
        "staleness": cfg.train.asynchronous.runs_ahead,
        "precision": compute_dtype != getattr(torch, cfg.model.dtype),
    }
    return tuple(kind for kind, present in kinds.items() if present)


def resolve_rollout_correction(cfg, mismatch: tuple[str, ...]) -> str:
    """The mode `algo.rollout_correction` means for this run, given its `mismatch_kinds`. `auto` follows TRL's
    default where TRL applies it (rollouts from another engine: vLLM) and where the weights differ (staleness). For a
    precision-only mismatch (a bfloat16 sampling copy of float32 masters) it truncates per token: a sequence ratio
    multiplies every token's rounding gap, and on the GSM8K-shaped model with a trained model's entropy the
    1,024-token completions' sequence ratios spread from 0.28 to 2.28 (a rescaling of whole completions that follows
    no policy change) where 99.8% of the token ratios lie within 0.87-1.15 (docs/results.md, "Rollout correction
    for a precision-only mismatch"); token weights also log the mismatch. None without a mismatch: it would only
    cost."""
    mode = cfg.algo.rollout_correction
    if mode != "auto":
        return mode
    if "engine" in mismatch or "staleness" in mismatch:
        return TRL_DEFAULT_MODE
    return PRECISION_MODE if mismatch else "none"


def async_generator(cfg: Config) -> str:
    """Where train.async's generator samples, as the memory planner counts it: "none" (no train.async),
    "in_process" (a thread of this process, with its own copy of the weights) or "workers" (the engine's worker
    processes; the generator's copy stays here)."""
    if not cfg.train.asynchronous.enabled:
        return "none"
    return "in_process" if cfg.rollout.engine_type.in_process else "workers"


def rows_in_flight(cfg: Config) -> int:
    """The rows the engine decodes at once as its `rows_option` sets them (0: unset, or no such option: what the
    device holds)."""
    return int(cfg.rollout.engine_options.get(cfg.rollout.engine_type.rows_option) or 0)


def keeps_decode_state(cfg: Config, device: str) -> bool:
    """Whether the configured engine keeps a decode state between calls, which a synchronous run keeps through the
    update where the plan fits it (train.async samples beside the update: generation_in_flight counts it there)."""
    return (not cfg.train.asynchronous.enabled
            and cfg.rollout.engine_type.keeps_decode_state(cfg.rollout.engine_options, device))


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
