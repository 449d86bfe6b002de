"""Selection kernels: which generated rollouts enter the update, vectorised over groups (no Python loop per group).

- PODS down-sampling (docs/methods.md#pods): keep m of each group's n rollouts by a rule. Rows arrive flat with an
  explicit `group_index` (groups may be unequal and interleaved). `pack_groups` turns them into a padded
  [P, n_max] table in generation order; the rules work on that table and return a keep mask; `select_rollouts` maps
  the mask back to sorted row indices.
- The PODS step (`pods_keep`): the rule's rows and their GRPO advantages, which methods/pods.py and the TRL
  integration (integrations/trl.py) both train on.
- AERO selective rejection (docs/methods.md#aero): `aero_select` keeps all successes and k times as many failures of a
  minority-success group, and `keep_dead` rollouts of an all-same group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from podsrl.algo.advantages import grpo_advantages
from podsrl.algo.group_stats import group_outcomes, group_stats, zero_variance_groups
from podsrl.batch import RolloutBatch

# A rule: (rewards [P, n], mask [P, n], m, generator) -> keep mask [P, n].
SelectionRule = Callable[[torch.Tensor, torch.Tensor, int, "torch.Generator | None"], torch.Tensor]


def pack_groups(
    values: torch.Tensor, group_index: torch.Tensor, num_groups: int, fill: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter flat rows into a [P, n_max] table, keeping row order within each group.

    Returns (padded values, valid mask, row index of each cell or -1 in padding).
    """
    if values.dim() != 1 or group_index.shape != values.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and group_index {tuple(group_index.shape)} must be [R]"
        )
    group_index = group_index.long()
    num_rows = values.numel()
    device = values.device
    if num_rows and (int(group_index.min()) < 0 or int(group_index.max()) >= num_groups):
        raise ValueError(
            f"group_index must lie in [0, {num_groups}), got [{int(group_index.min())}, "
            f"{int(group_index.max())}]"
        )
    counts = torch.bincount(group_index, minlength=num_groups)
    n_max = int(counts.max()) if num_groups else 0
    grouped = num_rows < 2 or bool((group_index[1:] >= group_index[:-1]).all())
    if grouped and num_groups and n_max * num_groups == num_rows:
        # The usual layout (prompt-major, n rows each): a view, no scatter at all.
        rows = torch.arange(num_rows, device=device).view(num_groups, n_max)
        mask = torch.ones((num_groups, n_max), dtype=torch.bool, device=device)
        return values.reshape(num_groups, n_max).clone(), mask, rows
    if grouped:
        order = torch.arange(num_rows, device=device)  # no sort needed
    else:
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


def _check(rewards: torch.Tensor, mask: torch.Tensor, m: int) -> None:
    if rewards.dim() != 2 or mask.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} must be [P, n]")
    if m < 1:
        raise ValueError(f"m (rows kept per group) must be >= 1, got {m}")


def _require_finite(ok: torch.Tensor) -> None:
    if not bool(ok.all()):
        raise ValueError("rewards contain NaN or inf; the selection rules need finite rewards")


def _ends(
    rewards: torch.Tensor, mask: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([P, m] largest values descending, [P, m] smallest ascending, [P] n_i); exact for groups with n_i >= m.

    A partial selection (topk) is all the rules need: no full sort of the group. It also checks finiteness
    cheaply: NaN and +inf surface as a group's largest value, -inf as its smallest.
    """
    inf = torch.tensor(float("inf"), dtype=rewards.dtype, device=rewards.device)
    top = torch.topk(torch.where(mask, rewards, -inf), m, dim=1, largest=True, sorted=True).values
    bottom = torch.topk(torch.where(mask, rewards, inf), m, dim=1, largest=False, sorted=True).values
    counts = mask.sum(dim=1)
    _require_finite(torch.isfinite(top[:, 0]) & torch.isfinite(bottom[:, 0]) | (counts == 0))
    return top, bottom, counts


def _threshold(ends: torch.Tensor, take: torch.Tensor, empty: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For taking the first `take` [P] of the sorted `ends` [P, m]: (last value taken, how many taken equal it).

    With take = 0 the threshold is `empty` (+-inf), which no finite reward reaches.
    """
    last = ends.gather(1, (take - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    last = torch.where(take > 0, last, torch.full_like(last, empty))
    slot = torch.arange(ends.shape[1], device=ends.device)
    ties = ((ends == last.unsqueeze(1)) & (slot < take.unsqueeze(1))).sum(1)
    return last, ties


def _keep_extremes(
    rewards: torch.Tensor, mask: torch.Tensor, top: torch.Tensor, k: torch.Tensor, bottom: torch.Tensor
) -> torch.Tensor:
    """Keep mask for "the k [P] highest + the m-k lowest" rows, the earliest rows winning among equal rewards.

    Every reward above the k-th largest value `hi` and below the (m-k)-th smallest `lo` is kept; of the rows equal
    to a threshold, the first few in generation order (a cumulative count) fill the remaining slots.
    """
    m = top.shape[1]
    hi, c_hi = _threshold(top, k, float("inf"))
    lo, c_lo = _threshold(bottom, m - k, float("-inf"))
    same = hi == lo  # both ends stop inside one run of equal rewards: it supplies c_hi + c_lo rows
    c_hi, c_lo = torch.where(same, c_hi + c_lo, c_hi), torch.where(same, 0, c_lo)
    hi, lo, c_hi, c_lo = (t.unsqueeze(1) for t in (hi, lo, c_hi, c_lo))
    eq_hi = mask & (rewards == hi)
    eq_lo = mask & (rewards == lo)
    keep = (rewards > hi) | (rewards < lo)
    keep |= eq_hi & (torch.cumsum(eq_hi.int(), 1) <= c_hi)
    keep |= eq_lo & (torch.cumsum(eq_lo.int(), 1) <= c_lo)
    return keep & mask


def max_variance_subset(rewards: torch.Tensor, mask: torch.Tensor, m: int) -> torch.Tensor:
    """Keep mask [P, n] of the m-subset of each group with the largest sample variance of rewards.

    Some optimum is "k highest + (m-k) lowest" (PODS), so each group evaluates the m+1 candidates with prefix sums
    of r and r^2 over its m largest and m smallest values. Ties between candidates: the top-m set (k = m) if it is
    optimal, else the smallest k; among equal rewards, earlier rows win. Groups with n_i <= m keep all their rows.
    """
    _check(rewards, mask, m)
    num_groups, n = rewards.shape
    if n <= m:
        return mask.clone()
    device = rewards.device
    top, bottom, counts = _ends(rewards, mask, m)
    full = (counts >= m).unsqueeze(1)  # other groups keep everything; their candidates are ignored
    # float64 and centring on the midrange keep sq - sum^2/m free of catastrophic cancellation.
    hi, lo = top[:, :1].double(), bottom[:, :1].double()
    centre = torch.where(full, (hi + lo) / 2, torch.zeros_like(hi))
    zero_col = torch.zeros((num_groups, 1), dtype=torch.float64, device=device)
    t = torch.where(full, top.double() - centre, zero_col)
    b = torch.where(full, bottom.double() - centre, zero_col)
    t1, t2 = (torch.cat([zero_col, torch.cumsum(v, 1)], dim=1) for v in (t, t * t))  # [P, m+1]
    b1, b2 = (torch.cat([zero_col, torch.cumsum(v, 1)], dim=1) for v in (b, b * b))
    # Candidate k: the top prefix of length k and the bottom prefix of length m-k (flip the bottom sums).
    s1 = t1 + b1.flip(1)
    s2 = t2 + b2.flip(1)
    var = (s2 - s1 * s1 / m) / max(m - 1, 1)  # [P, m+1], column k

    best = var.max(dim=1, keepdim=True).values
    # Candidates within rounding of the best count as tied, so that ties meant by the data (0.1 + 0.6 = 0.7 in
    # decimal) follow the documented order rather than representation noise: the float64 arithmetic errs by
    # ~1e-12 * m * range^2, and moving each reward by its dtype's rounding (eps * |r|) moves a variance by up
    # to ~2 * m * range * eps * |r|_max / (m - 1).
    spread = torch.where(full, hi - lo, zero_col)
    magnitude = torch.where(full, torch.maximum(hi.abs(), lo.abs()), zero_col)
    eps = torch.finfo(rewards.dtype).eps if rewards.is_floating_point() else 0.0
    tied = var >= best - m * spread * (1e-12 * spread + 4 * eps * magnitude)
    chosen = torch.where(tied[:, m], torch.full_like(counts, m), torch.argmax(tied.to(torch.uint8), dim=1))
    keep = _keep_extremes(rewards, mask, top, chosen, bottom)
    return torch.where((counts <= m).unsqueeze(1), mask, keep)  # small groups keep every valid row


def max_variance_decided(finished: torch.Tensor, m: int) -> bool:
    """Whether the max-variance m-subset of a group of rewards in [0, 1] is already among its finished rollouts'
    rewards `finished`, whatever its other rollouts get: m reward values in [0, 1] have the largest variance when
    they sit at the ends, as evenly as m allows, so once the finished hold floor(m/2) of each end and one more of
    either, no other reward can give a subset of more variance. Values inside (0, 1), and NaN, count for neither."""
    ones, zeros = int((finished >= 1).sum()), int((finished <= 0).sum())
    return min(ones, zeros) >= m // 2 and ones + zeros >= m


def max_reward_subset(rewards: torch.Tensor, mask: torch.Tensor, m: int) -> torch.Tensor:
    """Keep mask of each group's m largest rewards; among equal rewards, earlier rows win."""
    _check(rewards, mask, m)
    n = rewards.shape[1]
    if n <= m:
        return mask.clone()
    top, bottom, counts = _ends(rewards, mask, m)
    keep = _keep_extremes(rewards, mask, top, torch.full_like(counts, m), bottom)
    return torch.where((counts <= m).unsqueeze(1), mask, keep)


def random_subset(
    rewards: torch.Tensor, mask: torch.Tensor, m: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Keep mask of a uniform m-subset per group: the m largest of i.i.d. uniform keys (torch RNG if no generator)."""
    _check(rewards, mask, m)
    num_groups, n = rewards.shape
    if n <= m:
        return mask.clone()
    _require_finite(torch.isfinite(rewards) | ~mask)
    # drawn where the generator lives (a CPU generator cannot draw on CUDA), then moved to the rewards' device
    key_device = generator.device if generator is not None else rewards.device
    keys = torch.rand((num_groups, n), generator=generator, device=key_device).to(rewards.device)
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
        raise ValueError(f"unknown selection rule {rule!r}; choose one of {', '.join(sorted(SELECTION_RULES))}")
    if rule == "none":
        return torch.arange(rewards.numel(), device=rewards.device)
    padded, mask, rows = pack_groups(rewards, group_index, num_groups, fill=0.0)
    keep = SELECTION_RULES[rule](padded, mask, m, generator)
    num_rows = rewards.numel()
    # Back to row order without a sort: mark kept rows (dropped cells go to a spare slot), then list them.
    kept = torch.zeros(num_rows + 1, dtype=torch.bool, device=rewards.device)
    kept.scatter_(0, torch.where(keep, rows, num_rows).flatten(), True)
    return kept[:num_rows].nonzero().flatten()


def pods_keep(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    generated: int,
    m: int,
    rule: str,
    normalize_over: str,
    scale: str,
    epsilon: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PODS step (docs/methods.md#pods): (rows kept, ascending; their [len(rows)] float32 GRPO advantages).

    `rule` keeps m of each group's `generated` rows (all of them when m >= generated); the advantages' group
    statistics are over the kept rows (`normalize_over="subset"`) or the whole generated group ("group").
    """
    rows = select_rollouts(rewards, group_index, num_groups, m, rule if m < generated else "none", generator)
    stats = (rewards, group_index) if normalize_over == "group" else (None, None)
    advantages = grpo_advantages(rewards[rows], group_index[rows], num_groups, scale, epsilon, *stats)
    return rows, advantages


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
        stats = group_stats(r, g, num_groups)
        present = stats.count > 0
        denom = max(int(present.sum()), 1)
        zero = zero_variance_groups(r, g, num_groups) & present
        out[f"select/reward_std_{tag}"] = float(stats.std[present].sum() / denom)
        out[f"select/frac_zero_std_{tag}"] = float(zero.sum()) / denom
    return out


def aero_select(
    batch: RolloutBatch,
    posterior_mean: torch.Tensor,
    k: float,
    symmetric: bool,
    keep_dead: int,
    generator: torch.Generator | None = None,
    exempt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Selective rejection and dead-zone trimming. Returns (kept rows sorted ascending, dead [P] bool, metrics).

    Per group with c successes of n (u = c/n):
    - 0 < u < 0.5: all c successes + min(round(k·c), failures) random failures (at least 1, so a success/failure
      contrast survives even for k < 0.5); round is half-up.
    - symmetric and 0.5 < u < 1: all failures + min(round(k·f), successes) random successes (at least 1).
    - u = 0 or u = 1 (dead zone): `keep_dead` random rollouts (all if fewer).
    - anything else (u = 0.5, or u > 0.5 without `symmetric`): everything.
    Groups marked in `exempt` [P] bool (e.g. rescued groups with `aero.reject_rescued: false`) skip the rejection
    (they keep everything unless dead).
    """
    if batch.correct is None:
        raise ValueError("aero_select needs a scored batch (batch.correct is None)")
    num_groups = batch.num_groups
    if posterior_mean.shape != (num_groups,):
        raise ValueError(f"posterior_mean has shape {tuple(posterior_mean.shape)}, expected ({num_groups},)")
    g = batch.group_index
    correct = batch.correct.bool()
    device = g.device

    n, c = group_outcomes(g, correct, num_groups)
    f = n - c
    dead = (n > 0) & ((c == 0) | (c == n))
    minority = (c > 0) & (2 * c < n)
    majority = (f > 0) & (2 * f < n) if symmetric else torch.zeros_like(dead)
    if exempt is not None:
        minority, majority = minority & ~exempt, majority & ~exempt

    # Quota per (group, outcome) bucket 2g + correct; rows are ranked inside their bucket by a random key.
    quota_fail = torch.where(minority, _scaled_count(k, c).clamp(min=1).minimum(f), f)
    quota_succ = torch.where(majority, _scaled_count(k, f).clamp(min=1).minimum(c), c)
    quota_fail = torch.where(dead, f.clamp(max=keep_dead), quota_fail)
    quota_succ = torch.where(dead, c.clamp(max=keep_dead), quota_succ)
    quota = torch.stack([quota_fail, quota_succ], dim=1).reshape(-1)

    bucket = 2 * g + correct.long()
    key_device = generator.device if generator is not None else torch.device("cpu")
    keys = torch.rand(g.numel(), generator=generator, device=key_device).to(device)
    order = torch.argsort(keys)
    order = order[torch.argsort(bucket[order], stable=True)]
    sorted_bucket = bucket[order]
    bucket_sizes = torch.bincount(bucket, minlength=2 * num_groups)
    bucket_start = torch.cumsum(bucket_sizes, 0) - bucket_sizes
    rank = torch.arange(g.numel(), device=device) - bucket_start[sorted_bucket]
    kept = torch.sort(order[rank < quota[sorted_bucket]]).values

    nonempty = (n > 0).sum().clamp(min=1).float()
    kept_per_group = quota_fail + quota_succ
    rejected = (minority | majority) & (kept_per_group < n)
    metrics = {
        "aero/frac_rejected_groups": (rejected.sum() / nonempty).item(),
        "aero/frac_dead_zone": (dead.sum() / nonempty).item(),
        "aero/frac_rollouts_kept": kept.numel() / max(g.numel(), 1),
    }
    return kept, dead, metrics


def _scaled_count(k: float, count: torch.Tensor) -> torch.Tensor:
    """round(k·count), halves rounded up (torch.round would send 2.5 to 2)."""
    return torch.floor(k * count.double() + 0.5).long()
