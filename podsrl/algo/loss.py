"""Clipped token loss, loss aggregation and KL, as pure functions of per-token tensors ([B, T] = rollouts x tokens).

Aggregation is expressed as per-token weights computed over the whole mini-batch (not the micro-batch), so gradient
accumulation and data-parallel ranks give the same gradient as one big batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _token_mean(mask: torch.Tensor, stats: dict) -> torch.Tensor:
    return mask / stats["num_tokens"]


def _seq_mean_token_mean(mask: torch.Tensor, stats: dict) -> torch.Tensor:
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    return mask / lengths / stats["num_sequences"]


def _seq_mean_token_sum_norm(mask: torch.Tensor, stats: dict) -> torch.Tensor:
    return mask / (stats["max_length"] * stats["num_sequences"])


# name -> f(mask [B, T], mini-batch stats) -> weights [B, T]; loss = sum(weights * per_token_loss)
LOSS_AGGREGATIONS: dict[str, Callable[[torch.Tensor, dict], torch.Tensor]] = {
    "token_mean": _token_mean,  # DAPO / TRL default: every valid token of the mini-batch counts equally
    "seq_mean_token_mean": _seq_mean_token_mean,  # original GRPO: mean over tokens, then over sequences
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,  # Dr.GRPO: token sum / constant max length
}


def aggregation_stats(completion_mask: torch.Tensor, max_length: int) -> dict:
    """Mini-batch totals the aggregation weights need (`max_length` is the configured completion cap)."""
    return {
        "num_tokens": float(completion_mask.sum().clamp(min=1)),
        "num_sequences": float(max(1, completion_mask.shape[0])),
        "max_length": float(max_length),
    }


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss -min(rho A, clip(rho) A); also the masks of tokens clipped low and high."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return loss, low, high


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(q - p) - (q - p) - 1, q = ref log-prob, p = policy log-prob."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1
