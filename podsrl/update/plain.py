"""The reference forward of the update: every row runs prompt + completion through the model's own forward.

Works for any causal LM; the shared-prompt path (shared_prompt.py) must equal it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from podsrl.batch import RolloutBatch
from podsrl.models.logprobs import token_logprobs_and_entropy


def plain_logprobs(model: torch.nn.Module, batch: RolloutBatch, rows: Tensor, width: int, device: torch.device,
                   temperature: float, logits_chunk: int) -> tuple[Tensor, Tensor]:
    """[B, width] log-probs of the completion tokens and [B, width] entropies, one forward of prompt + completion.

    Position ids follow the left padding (as generation does); right padding of completions needs no mask since
    causal attention never lets an earlier position see it.
    """
    prompt_ids = batch.prompt_ids[rows].to(device)
    prompt_mask = batch.prompt_mask[rows].to(device)
    completion_ids = batch.completion_ids[rows, :width].to(device)
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
