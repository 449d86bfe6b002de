"""THE per-group statistics of values over rows with an explicit group index (groups of any size, interleaved).

Every advantage, selection metric and step metric reads group means and stds from here, so the edge cases are
decided once: the std is unbiased, 0 for a group of one row; a group is `constant` when it has fewer than two rows
or all its values are equal, and such a group gets exactly zero advantage everywhere (not a rounding residue).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupStats:
    mean: torch.Tensor  # [P] float64, 0 for an empty group
    std: torch.Tensor  # [P] float64, unbiased; 0 for groups of fewer than two rows
    count: torch.Tensor  # [P] long, rows per group
    spread: torch.Tensor  # [P] float64, max - min of the group's values (0 for an empty group)

    @property
    def constant(self) -> torch.Tensor:
        """[P] bool: fewer than two rows, or all values equal (no learning signal)."""
        return (self.count < 2) | (self.spread == 0)


def group_stats(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> GroupStats:
    """Mean, unbiased std, row count and spread of `values` [R] per group; `group_index` [R] in [0, num_groups)."""
    v = values.double()
    g = group_index.long()
    count = torch.bincount(g, minlength=num_groups)
    n = count.double()
    mean = torch.bincount(g, weights=v, minlength=num_groups) / n.clamp(min=1)
    sq = torch.bincount(g, weights=(v - mean[g]) ** 2, minlength=num_groups)
    std = torch.where(count > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    hi = torch.full((num_groups,), float("-inf"), dtype=torch.float64, device=v.device).scatter_reduce(0, g, v, "amax")
    lo = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=v.device).scatter_reduce(0, g, v, "amin")
    spread = torch.where(count > 0, hi - lo, torch.zeros_like(hi))
    return GroupStats(mean=mean, std=std, count=count, spread=spread)


def zero_variance_groups(
    rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int, atol: float = 1e-6
) -> torch.Tensor:
    """[P] bool: groups whose rewards all agree within `atol` (max - min); empty groups count as True."""
    stats = group_stats(rewards, group_index, num_groups)
    return (stats.count == 0) | (stats.spread <= atol)


def group_outcomes(
    group_index: torch.Tensor, success: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([P] attempts, [P] successes), long: rows per group, and rows per group whose `success` [R] flag is set."""
    g = group_index.long()
    attempts = torch.bincount(g, minlength=num_groups)
    successes = torch.bincount(g[success.bool()], minlength=num_groups)
    return attempts, successes
