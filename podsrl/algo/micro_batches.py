"""Micro-batches of an update: rows alone (optim.micro_batch_size) or rows under a token budget
(optim.micro_batch_tokens, verl's ppo_max_token_len_per_gpu).

Rows keep their order, so a group's completions stay together and the shared-prompt path still runs each prompt
once per micro-batch. A budget cut bounds a micro-batch's tokens where a row count bounds only its rows: with
256-4,096-token completions the same number of rows can differ 16x in tokens, so a row count sized for the longest
batch wastes memory on the others and one sized for the average runs out on the longest."""

from __future__ import annotations

import torch


def row_tokens(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """[R] long: each row's prompt and completion tokens, what its forward computes."""
    return (prompt_mask.sum(dim=1) + completion_mask.sum(dim=1)).long()


def split_rows(rows: torch.Tensor, max_rows: int, lengths: torch.Tensor | None = None,
               max_tokens: int = 0) -> list[torch.Tensor]:
    """Consecutive micro-batches of `rows`, each at most `max_rows` rows and, with `max_tokens` > 0, at most
    `max_tokens` tokens (`lengths[row]`: a row's tokens); a row longer than the budget runs alone."""
    if max_tokens <= 0 or rows.numel() == 0:
        return list(rows.split(max_rows))
    sizes, tokens, count = [], 0, 0
    for n in lengths[rows].tolist():
        if count and (count == max_rows or tokens + n > max_tokens):
            sizes.append(count)
            tokens, count = 0, 0
        tokens += n
        count += 1
    sizes.append(count)
    return list(rows.split(sizes))
