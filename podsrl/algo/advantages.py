"""Sequence-level advantages over groups of unequal size (rows carry an explicit group index)."""

from __future__ import annotations

import torch


def group_mean_std(values: torch.Tensor, group_index: torch.Tensor, num_groups: int):
    """([P] mean, [P] unbiased std, [P] count) of `values` per group; std is 0 for groups of size < 2."""
    values = values.double()
    count = torch.bincount(group_index, minlength=num_groups).double()
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, values)
    mean = total / count.clamp(min=1)
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, (values - mean[group_index]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return mean, std, count


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    scale: str = "group",
    epsilon: float = 1e-4,
    stats_rewards: torch.Tensor | None = None,
    stats_group_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_r = (r - mean_g) / (std + eps) with std per group ('group'), over the batch ('batch'), or none ('none').

    Statistics come from (`stats_rewards`, `stats_group_index`) when given, e.g. the whole generated group while the
    advantages are for the kept subset (PODS `normalize_over: group`). A group of size 1 gets advantage 0.
    """
    if stats_rewards is None:
        stats_rewards, stats_group_index = rewards, group_index
    mean, std, count = group_mean_std(stats_rewards, stats_group_index, num_groups)
    centred = rewards.double() - mean[group_index]
    if scale == "group":
        adv = centred / (std[group_index] + epsilon)
    elif scale == "batch":
        adv = centred / (stats_rewards.double().std() + epsilon if stats_rewards.numel() > 1 else 1.0)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"algo.scale: unknown {scale!r}")
    adv = torch.where(count[group_index] > 1, adv, torch.zeros_like(adv))
    return adv.float()
