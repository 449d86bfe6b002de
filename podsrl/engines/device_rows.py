"""How many rows the fast engine decodes at once on a CUDA device by default: what the memory plan fits in the
device's free memory now (podsrl/planning/memory.py rows_in_flight), within the rows the run's plan counted beside
the update where the trainer keeps the decode state through it (RolloutEngine.plan_rows)."""

from __future__ import annotations

import torch

from podsrl.engines.hf import model_device
from podsrl.planning.memory import RESERVE, rows_in_flight
from podsrl.planning.workload import ModelShape, Workload


def plan_rows_in_flight(model: torch.nn.Module, shape: ModelShape, prompts: list[list[int]], counts: list[int],
                        steps: int, top_p: float, kept: int) -> int:
    """The memory plan's rows in flight for this call on the model's CUDA device: what its free memory (less
    memory_plan.RESERVE of the device, plus the engine's own kept state, `kept` bytes) holds. Free is the device's
    and the allocator's cached free blocks of its default pool; a private pool's (the CUDA graphs') serve only
    captures into it, so they are not counted."""
    device = model_device(model)
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    available = min(free + default_pool_free(device), int(total * (1 - RESERVE)) - allocated) + kept
    used = [len(p) for p, c in zip(prompts, counts) if c > 0]
    dtype = str(next(model.parameters()).dtype).split(".")[-1]
    work = Workload(prompts=len(used), n=-(-sum(counts) // len(used)), m=1, prompt_length=max(used),
                    completion_length=steps, dtype=dtype, compute_dtype=dtype, top_p=top_p, device="cuda")
    return rows_in_flight(shape, work, available)


def default_pool_free(device: torch.device) -> int:
    """Bytes the caching allocator holds free in its default pool on `device` (segments reserved less allocated),
    which any allocation may reuse; memory_reserved - memory_allocated would count the private pools' free blocks
    too."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(segment["total_size"] - segment["allocated_size"] for segment in torch.cuda.memory_snapshot()
               if segment["device"] == index and tuple(segment["segment_pool_id"]) == (0, 0))
