"""Helpers shared by the in-process engines: request checks, special token ids, completion masks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from podsrl.engines.base import GenerationOutput, SamplingParams, left_pad


def check_request(prompts: list[list[int]], counts: list[int], seeds: torch.Tensor) -> int:
    """Validates a generate() call; returns the number of rows R = sum(counts)."""
    if len(prompts) != len(counts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(counts)} counts")
    if any(c < 0 for c in counts):
        raise ValueError(f"generate: counts must be >= 0, got {counts}")
    rows = int(sum(counts))
    if seeds.numel() != rows:
        raise ValueError(f"generate: need one seed per row ({rows}), got {seeds.numel()}")
    if any(len(p) == 0 for p, c in zip(prompts, counts) if c > 0):
        raise ValueError("generate: a prompt with rollouts has no tokens")
    return rows


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return [int(v) for v in value]
    return [int(value)]


def special_ids(model: torch.nn.Module, tokenizer: Any, options: dict[str, Any]) -> tuple[list[int], int]:
    """(EOS ids, pad id). The EOS ids are the option's when given, else every id that ends a completion for the
    model: the tokenizer's EOS and its generation config's (an instruct model lists several there, e.g. Qwen2.5's
    <|im_end|> and <|endoftext|>; model.generate and vLLM stop at each), or its config's when it has no generation
    config. The pad id is the option's, else the tokenizer's, else the first EOS."""
    eos = _as_ids(options.get("eos_token_id"))
    if not eos:
        declared = getattr(model, "generation_config", None) or getattr(model, "config", None)
        eos = list(dict.fromkeys(_as_ids(getattr(tokenizer, "eos_token_id", None))
                                 + _as_ids(getattr(declared, "eos_token_id", None))))
    pad = options.get("pad_token_id")
    if pad is None:
        pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, int(pad)


def stop_ids(eos_ids: list[int], params: SamplingParams) -> list[int]:
    return sorted(set(eos_ids) | {int(t) for t in params.stop_token_ids})


def completion_mask(tokens: torch.Tensor, stops: list[int], lengths: torch.Tensor | None = None):
    """(mask [R, Lc] float, truncated [R] bool): 1 up to and including the first stop token.

    `lengths` (when given) caps each row's mask at its number of generated tokens (padding past the end of a row
    that never stopped must not count even if the pad id is a stop id).
    """
    is_stop = torch.isin(tokens, torch.tensor(stops, dtype=tokens.dtype, device=tokens.device))
    before_first = (is_stop.long().cumsum(dim=1) - is_stop.long()) == 0
    if lengths is not None:
        before_first &= torch.arange(tokens.shape[1], device=tokens.device) < lengths.unsqueeze(1)
    stopped = (is_stop & before_first).any(dim=1)
    return before_first.float(), ~stopped


def no_token_output(
    prompts: list[list[int]], counts: list[int], rows: int, pad_token_id: int, return_logprobs: bool
) -> GenerationOutput:
    """Output of a call that generates nothing (no rows, or max_new_tokens <= 0: every row truncated)."""
    if rows == 0:
        group_index = torch.zeros(0, dtype=torch.long)
        prompt_ids, prompt_mask = torch.zeros((0, 0), dtype=torch.long), torch.zeros((0, 0), dtype=torch.long)
    else:
        group_index, prompt_ids, prompt_mask = row_prompts(prompts, counts, pad_token_id)
    return GenerationOutput(
        group_index=group_index,
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=torch.zeros((rows, 0), dtype=torch.long),
        completion_mask=torch.zeros((rows, 0)),
        truncated=torch.ones(rows, dtype=torch.bool),
        logprobs=torch.zeros((rows, 0)) if return_logprobs else None,
    )


def row_prompts(prompts: list[list[int]], counts: list[int], pad_token_id: int):
    """(group_index [R], prompt_ids [R, Lp], prompt_mask [R, Lp]) with rows grouped by prompt in order."""
    group_index = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(counts, dtype=torch.long))
    used = [p for p, c in zip(prompts, counts) if c > 0]
    ids, mask = left_pad(used, pad_token_id)
    per_used = torch.tensor([c for c in counts if c > 0], dtype=torch.long)
    return group_index, ids.repeat_interleave(per_used, dim=0), mask.repeat_interleave(per_used, dim=0)
