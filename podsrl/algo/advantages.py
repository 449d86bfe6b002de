"""Sequence-level advantages over groups of unequal size (rows carry an explicit group index): GRPO's, and AERO's
posterior advantage for dead-zone groups. Group statistics come from the one helper in group_stats.py."""

from __future__ import annotations

import torch

from podsrl.algo.group_stats import group_stats

SCALES = ("group", "batch", "none")
DEAD_ZONE_MODES = ("baseline", "constant")


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    scale: str = "group",
    epsilon: float = 1e-4,
    stats_rewards: torch.Tensor | None = None,
    stats_group_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R] float32 A_r = (r - mean_g) / (std + eps) with std per group ('group'), over the batch ('batch'), or none.

    Statistics come from (`stats_rewards`, `stats_group_index`) when given, e.g. the whole generated group while the
    advantages are for the kept subset (PODS `normalize_over: group`). A constant group (one row, or all rewards
    equal) gets exactly 0.
    """
    if scale not in SCALES:
        raise ValueError(f"algo.scale: unknown {scale!r}")
    if stats_rewards is None:
        stats_rewards, stats_group_index = rewards, group_index
    stats = group_stats(stats_rewards, stats_group_index, num_groups)
    centred = rewards.double() - stats.mean[group_index]
    if scale == "group":
        adv = centred / (stats.std[group_index] + epsilon)
    elif scale == "batch":
        adv = centred / (stats_rewards.double().std() + epsilon if stats_rewards.numel() > 1 else 1.0)
    else:
        adv = centred
    return torch.where(stats.constant[group_index], torch.zeros_like(adv), adv).float()


def aero_advantages(
    rewards: torch.Tensor,
    correct: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    dead: torch.Tensor,
    posterior_mean: torch.Tensor,
    mode: str,
    epsilon: float,
    scale: str,
) -> torch.Tensor:
    """[R] float32 advantages of AERO's kept rows: posterior treatment for dead groups, GRPO over the kept rows
    otherwise (docs/methods.md#aero).

    Dead groups, with ũ = posterior_mean[group]:
    - "baseline": (x − ũ) / sqrt(ũ(1−ũ)), denominator clamped to >= epsilon. x is the correctness bit, not the
      training reward: ũ is a success rate, so this is the standardised Bernoulli score, and a format bonus on top
      of the reward could otherwise turn failures in an all-fail group into positive advantages.
    - "constant": 2ũ − 1 for every kept rollout of the group.
    """
    if mode not in DEAD_ZONE_MODES:
        raise ValueError(f"dead-zone advantage mode must be one of {DEAD_ZONE_MODES}, got {mode!r}")
    if dead.shape != (num_groups,) or posterior_mean.shape != (num_groups,):
        raise ValueError(
            f"dead {tuple(dead.shape)} and posterior_mean {tuple(posterior_mean.shape)} must both be ({num_groups},)"
        )
    adv = grpo_advantages(rewards, group_index, num_groups, scale, epsilon).double()
    u = posterior_mean.to(device=rewards.device, dtype=torch.float64)[group_index]
    if mode == "baseline":
        dz = (correct.double() - u) / (u * (1.0 - u)).clamp(min=0.0).sqrt().clamp(min=epsilon)
    else:
        dz = 2.0 * u - 1.0
    row_dead = dead.to(rewards.device)[group_index]
    return torch.where(row_dead, dz, adv).float()
