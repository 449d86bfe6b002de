"""The update's shared-prompt path over a batch: each distinct prompt of a micro-batch runs once, completions run
without padding (podsrl/models/packed.py computes it; this adapts a batch's rows to its packed layout)."""

from __future__ import annotations

import torch
from torch import Tensor

from podsrl.batch import RolloutBatch
from podsrl.models.packed import PackedForward
from podsrl.models.packed_layout import build_plan
from podsrl.models.transformers_api import sliding_window


class SharedPromptForward:
    """Log-probs and entropies of rows of a batch under a model it can drive (see packed_forward_problem)."""

    def __init__(self, model: torch.nn.Module, logits_chunk: int, activation_checkpointing: bool = False,
                 ladder: bool | None = None, keep_plans: bool = False) -> None:
        self.forward = PackedForward(model, logits_chunk, activation_checkpointing, keep_plans)
        self.window = sliding_window(model)
        self.ladder = ladder  # attention blocks rounded up to the shape ladder (None: on CUDA only; build_plan)

    def fits(self, batch: RolloutBatch, rows: Tensor, width: int) -> bool:
        """False when some row is longer than a sliding window (then windowed attention would differ)."""
        if self.window is None:
            return True
        longest = int(batch.prompt_mask[rows].sum(dim=1).max()) + width
        return longest <= self.window

    def __call__(self, batch: RolloutBatch, rows: Tensor, width: int, device: torch.device,
                 temperature: float) -> tuple[Tensor, Tensor] | None:
        """([B, width] log-probs, [B, width] entropies; 0 outside the completion mask), or None when this
        micro-batch has rows the plan cannot express."""
        plan = build_plan(batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows, :width],
                          batch.completion_mask[rows, :width], device, self.ladder)
        if plan is None:
            return None
        return self.forward(plan, temperature)
