"""Whether the rollout engine's decode state (KV cache, step state, captured CUDA graphs) stays on the device through
each update. Memory is either freed before the next phase or counted by the plan: the state is kept only where the
memory plan fits it beside the update (podsrl/planning/memory.py decode_state_fits), so a step replays the graphs
the earlier steps captured instead of capturing each bucket anew; elsewhere the trainer releases it before each
update, and one start-up line says so."""

from __future__ import annotations

import logging
import os

import torch

from podsrl.engines import RolloutEngine
from podsrl.memory_plan import kept_decode_rows
from podsrl.tasks.prompt_length import longest_prompt

log = logging.getLogger("podsrl")


def device_memory(device: torch.device) -> int:
    """Bytes of the device: a GPU's, or the host's physical memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def keeps_engine_state(cfg, micro_batch: int, engine: RolloutEngine, model: torch.nn.Module, task, tokenizer,
                       device: torch.device, world_size: int, speak: bool) -> bool:
    """True where the (synchronous) run's engine keeps a decode state between calls and the plan fits it beside the
    update at the run's micro-batch (`micro_batch` rows: optim.micro_batch_size, auto decided) on this device; the
    engine then decodes no more rows at once than the plan counted (RolloutEngine.plan_rows): the first call's free
    memory does not hold the optimiser's state and the gradients yet, and a state sized by it would stay that size
    through every update."""
    if cfg.train.asynchronous.enabled or not engine.keeps_state_across_updates:
        return False
    prompt_length = cfg.task.max_prompt_length or longest_prompt(task, tokenizer)
    memory = device_memory(device)
    rows = kept_decode_rows(cfg, model.config, prompt_length, device.type, world_size, memory, micro_batch)
    if rows:
        engine.plan_rows(rows)
        return True
    if speak:
        log.info("the engine's decode state (KV cache, CUDA graphs) is freed before each update: the memory plan "
                 "does not fit it beside the update (micro-batches of %d rows) in this device's %.1f GiB, so each "
                 "step captures its graphs anew (`podsrl plan --memory` shows the terms)",
                 micro_batch, memory / 2**30)
    return False
