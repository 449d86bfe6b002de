"""PODS down-sampling: keep m of each group's n rollouts (METHODS.md §2), vectorised over groups.

Rows arrive flat with an explicit `group_index` (groups may be unequal and interleaved). `pack_groups` turns them
into a padded [P, n_max] table in generation order; the rules work on that table and return a keep mask; and
`select_rollouts` maps the mask back to sorted row indices. No rule loops over groups in Python.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from podsrl.errors import ConfigError

# A rule: (rewards [P, n], mask [P, n], m, generator) -> keep mask [P, n].
SelectionRule = Callable[[torch.Tensor, torch.Tensor, int, "torch.Generator | None"], torch.Tensor]


def pack_groups(
    values: torch.Tensor, group_index: torch.Tensor, num_groups: int, fill: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter flat rows into a [P, n_max] table, keeping row order within each group.

    Returns (padded values, valid mask, row index of each cell or -1 in padding).
    """
    if values.dim() != 1 or group_index.shape != values.shape:
        raise ValueError(f"values {tuple(values.shape)} and group_index {tuple(group_index.shape)} must be [R]")
    group_index = group_index.long()
    num_rows = values.numel()
    device = values.device
    if num_rows and (int(group_index.min()) < 0 or int(group_index.max()) >= num_groups):
        raise ValueError(f"group_index must lie in [0, {num_groups}), got [{int(group_index.min())}, "
                         f"{int(group_index.max())}]")
    counts = torch.bincount(group_index, minlength=num_groups)
    n_max = int(counts.max()) if num_groups else 0
    order = torch.argsort(group_index, stable=True)  # groups contiguous, generation order inside each
    sorted_groups = group_index[order]
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(num_rows, device=device) - starts[sorted_groups]
    padded = torch.full((num_groups, n_max), fill, dtype=values.dtype, device=device)
    mask = torch.zeros((num_groups, n_max), dtype=torch.bool, device=device)
    rows = torch.full((num_groups, n_max), -1, dtype=torch.long, device=device)
    padded[sorted_groups, column] = values[order]
    mask[sorted_groups, column] = True
    rows[sorted_groups, column] = order
    return padded, mask, rows


def _sort_desc(rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable descending sort per group with padding last: returns (permutation, sorted values)."""
    by_value = torch.sort(rewards, dim=1, descending=True, stable=True).indices
    # A second stable sort on validity moves padding to the end without disturbing the value order.
    by_valid = torch.sort(mask.gather(1, by_value).to(torch.uint8), dim=1, descending=True, stable=True).indices
    perm = by_value.gather(1, by_valid)
    return perm, rewards.gather(1, perm)


def _check(rewards: torch.Tensor, mask: torch.Tensor, m: int) -> None:
    if rewards.dim() != 2 or mask.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} must be [P, n]")
    if m < 1:
        raise ConfigError(f"select.m must be >= 1, got {m}")
    if not torch.isfinite(rewards[mask]).all():
        raise ValueError("rewards contain NaN or inf; the selection rules need finite rewards")


def _earliest_in_ties(sorted_values: torch.Tensor, keep_sorted: torch.Tensor) -> torch.Tensor:
    """Within each run of equal values (in sorted order), move the kept slots to the run's front.

    The kept multiset of values is unchanged; among equal rewards the rows earlier in generation order win,
    because the stable sort placed them first in their run.
    """
    num_groups, n = sorted_values.shape
    if n == 0:
        return keep_sorted
    pos = torch.arange(n, device=sorted_values.device).expand(num_groups, n)
    new_run = torch.ones_like(keep_sorted)
    new_run[:, 1:] = sorted_values[:, 1:] != sorted_values[:, :-1]
    run_id = torch.cumsum(new_run.long(), dim=1) - 1
    run_start = torch.cummax(torch.where(new_run, pos, torch.zeros_like(pos)), dim=1).values
    kept_per_run = torch.zeros_like(run_id).scatter_add_(1, run_id, keep_sorted.long())
    return (pos - run_start) < kept_per_run.gather(1, run_id)


def _unsort(perm: torch.Tensor, keep_sorted: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(keep_sorted).scatter_(1, perm, keep_sorted)


def max_variance_subset(rewards: torch.Tensor, mask: torch.Tensor, m: int) -> torch.Tensor:
    """Keep mask [P, n] of the m-subset of each group with the largest sample variance of rewards.

    Some optimum is "k highest + (m-k) lowest" (PODS), so each group evaluates the m+1 candidates with prefix sums
    of r and r^2 over its descending sort. Ties between candidates: the top-m set (k = m) if it is optimal, else the
    smallest k; among equal rewards, earlier rows win. Groups with n_i <= m keep all their rows.
    """
    _check(rewards, mask, m)
    num_groups, n = rewards.shape
    if n <= m:
        return mask.clone()
    device = rewards.device
    counts = mask.sum(dim=1)  # n_i
    perm, sorted_values = _sort_desc(rewards, mask)
    valid_sorted = mask.gather(1, perm)
    # float64 and centring on the group mean keep sq - sum^2/m free of catastrophic cancellation.
    x = torch.where(valid_sorted, sorted_values.double(), torch.zeros((), dtype=torch.float64, device=device))
    x = torch.where(valid_sorted, x - x.sum(1, keepdim=True) / counts.clamp(min=1).unsqueeze(1), x)
    zero_col = torch.zeros((num_groups, 1), dtype=torch.float64, device=device)
    p1 = torch.cat([zero_col, torch.cumsum(x, 1)], dim=1)  # [P, n+1]
    p2 = torch.cat([zero_col, torch.cumsum(x * x, 1)], dim=1)

    k = torch.arange(m + 1, device=device).expand(num_groups, m + 1)  # candidates
    bottom_start = (counts.unsqueeze(1) - (m - k)).clamp(min=0)  # sorted position where the lowest m-k begin
    end = counts.unsqueeze(1).expand_as(k)
    s1 = p1.gather(1, k) + p1.gather(1, end) - p1.gather(1, bottom_start)
    s2 = p2.gather(1, k) + p2.gather(1, end) - p2.gather(1, bottom_start)
    var = (s2 - s1 * s1 / m) / max(m - 1, 1)

    best = var.max(dim=1, keepdim=True).values
    # Rounding can split exact ties between different candidates; treat values within a hair of the best as tied.
    scale = p2[:, -1:].clamp(min=1e-300)  # sum of squared deviations of the whole group bounds every s2
    tied = var >= best - 1e-12 * scale
    chosen = torch.where(tied[:, m], torch.full_like(counts, m), torch.argmax(tied.to(torch.uint8), dim=1))

    pos = torch.arange(n, device=device).expand(num_groups, n)
    chosen_bottom = (counts - (m - chosen)).unsqueeze(1)
    keep_sorted = (pos < chosen.unsqueeze(1)) | ((pos >= chosen_bottom) & (pos < counts.unsqueeze(1)))
    keep_sorted = _earliest_in_ties(sorted_values, keep_sorted) & valid_sorted
    keep = _unsort(perm, keep_sorted)
    small = counts <= m  # such groups keep every valid row
    return torch.where(small.unsqueeze(1), mask, keep)


def max_reward_subset(rewards: torch.Tensor, mask: torch.Tensor, m: int) -> torch.Tensor:
    """Keep mask of each group's m largest rewards; among equal rewards, earlier rows win."""
    _check(rewards, mask, m)
    num_groups, n = rewards.shape
    if n <= m:
        return mask.clone()
    perm, _ = _sort_desc(rewards, mask)
    pos = torch.arange(n, device=rewards.device).expand(num_groups, n)
    return _unsort(perm, (pos < m) & mask.gather(1, perm))


def random_subset(
    rewards: torch.Tensor, mask: torch.Tensor, m: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Keep mask of a uniform m-subset per group: the m largest of i.i.d. uniform keys (torch RNG if no generator)."""
    _check(rewards, mask, m)
    num_groups, n = rewards.shape
    if n <= m:
        return mask.clone()
    keys = torch.rand((num_groups, n), generator=generator, device=rewards.device)
    keys = torch.where(mask, keys, torch.full_like(keys, -1.0))  # padding never beats a real row
    top = torch.topk(keys, m, dim=1).indices
    keep = torch.zeros_like(mask).scatter_(1, top, True)
    return keep & mask


SELECTION_RULES: dict[str, SelectionRule] = {
    "max_variance": lambda r, mask, m, gen: max_variance_subset(r, mask, m),
    "max_reward": lambda r, mask, m, gen: max_reward_subset(r, mask, m),
    "random": random_subset,
    "none": lambda r, mask, m, gen: mask.clone(),
}


def select_rollouts(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    m: int,
    rule: str,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Row indices (long, ascending) kept by `rule` (a key of SELECTION_RULES); "none" keeps every row."""
    if rule not in SELECTION_RULES:
        raise ConfigError(f"select.rule: unknown rule {rule!r}; choose one of {', '.join(sorted(SELECTION_RULES))}")
    if rule == "none":
        return torch.arange(rewards.numel(), device=rewards.device)
    padded, mask, rows = pack_groups(rewards, group_index, num_groups, fill=0.0)
    keep = SELECTION_RULES[rule](padded, mask, m, generator)
    return torch.sort(rows[keep]).values


def zero_variance_groups(
    rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int, atol: float = 1e-6
) -> torch.Tensor:
    """[P] bool: groups whose rewards all agree within `atol` (max - min); empty groups count as True."""
    group_index = group_index.long()
    r = rewards.double()
    hi = torch.full((num_groups,), float("-inf"), dtype=torch.float64, device=r.device)
    lo = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=r.device)
    hi = hi.scatter_reduce(0, group_index, r, reduce="amax")
    lo = lo.scatter_reduce(0, group_index, r, reduce="amin")
    empty = torch.bincount(group_index, minlength=num_groups) == 0
    return empty | ((hi - lo) <= atol)


def _group_std(rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([P] unbiased within-group std, 0 for groups of one row; [P] row counts)."""
    r = rewards.double()
    counts = torch.bincount(group_index, minlength=num_groups).double()
    mean = torch.bincount(group_index, weights=r, minlength=num_groups) / counts.clamp(min=1)
    sq = torch.bincount(group_index, weights=(r - mean[group_index]) ** 2, minlength=num_groups)
    std = torch.where(counts >= 2, (sq / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return std, counts


def selection_metrics(
    rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int, kept_rows: torch.Tensor
) -> dict[str, float]:
    """Mean within-group reward std and fraction of zero-std groups, before and after selection.

    Means are over non-empty groups; a one-row group has std 0. "Zero std" uses `zero_variance_groups`.
    """
    group_index = group_index.long()
    out: dict[str, float] = {}
    for tag, r, g in (
        ("before", rewards, group_index),
        ("after", rewards[kept_rows], group_index[kept_rows]),
    ):
        std, counts = _group_std(r, g, num_groups)
        present = counts > 0
        denom = max(int(present.sum()), 1)
        zero = zero_variance_groups(r, g, num_groups) & present
        out[f"select/reward_std_{tag}"] = float(std[present].sum() / denom)
        out[f"select/frac_zero_std_{tag}"] = float(zero.sum()) / denom
    return out
