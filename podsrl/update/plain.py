"""The reference forward of the update: every row runs prompt + completion through the model's own forward.

Works for any causal LM; the shared-prompt path (shared_prompt.py) must equal it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from podsrl.batch import RolloutBatch
from podsrl.errors import ConfigError
from podsrl.models.logprobs import token_logprobs_and_entropy
from podsrl.models.transfer import to_device
from podsrl.models.transformers_api import base_model, enable_layer_checkpointing


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """transformers' own per-layer checkpointing (torch.utils.checkpoint, non-reentrant: no inputs need
    requires_grad, so a frozen LoRA base works) for this path's forward. It stays on: a layer checkpoints only in
    training mode with gradients enabled, so generation (no_grad/inference_mode) and the old/reference log-probs
    (no_grad) run without recomputation and keep their KV cache."""
    base = base_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(f"update.activation_checkpointing: {type(base).__name__} does not support transformers' "
                          "activation checkpointing; set update.activation_checkpointing=false")
    enable_layer_checkpointing(base)


def plain_logprobs(model: torch.nn.Module, batch: RolloutBatch, rows: Tensor, width: int, device: torch.device,
                   temperature: float, logits_chunk: int) -> tuple[Tensor, Tensor]:
    """[B, width] log-probs of the completion tokens and [B, width] entropies, one forward of prompt + completion.

    Position ids follow the left padding (as generation does); right padding of completions needs no mask since
    causal attention never lets an earlier position see it.
    """
    prompt_ids, prompt_mask, completion_ids = to_device(
        [batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows, :width]], device)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=width + 1,
        use_cache=False,
    ).logits[:, :-1]
    return token_logprobs_and_entropy(logits, completion_ids, temperature, logits_chunk)
