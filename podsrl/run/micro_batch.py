"""optim.micro_batch_size=0 (auto), decided once at start-up: the largest micro-batch the memory plan fits on the
run's device, at most a rank's mini-batch (podsrl/memory_plan.py auto_micro_batch). Each micro-batch
costs the update its launches again (~1,500 for configs/gpu_pods_study.yaml), so one where the plan fits the
mini-batch; the gradients are the same at any size. The decision is a part of the run (RunParts.micro_batch), handed
to the update (UpdateSettings.micro_batch_size) and the engine-state plan; the config keeps the 0 it was loaded with."""

from __future__ import annotations

import logging

import torch

from podsrl.memory_plan import auto_micro_batch
from podsrl.run.engine_state import device_memory
from podsrl.tasks.prompt_length import longest_prompt

log = logging.getLogger("podsrl")


def resolve_micro_batch(cfg, model: torch.nn.Module, task, tokenizer, device: torch.device, world_size: int,
                        speak: bool) -> int:
    """The rows per micro-batch on each rank: optim.micro_batch_size where it is set, else what auto decides on this
    device, which one log line says with its reason."""
    if cfg.optim.micro_batch_size > 0:
        return cfg.optim.micro_batch_size
    prompt_length = cfg.task.max_prompt_length or longest_prompt(task, tokenizer)
    rows, why = auto_micro_batch(cfg, model.config, prompt_length, device.type, world_size, device_memory(device))
    if speak:
        log.info("update: optim.micro_batch_size=auto -> %d rows per micro-batch on each rank: %s", rows, why)
    return rows
