"""Reinforce-Ada: sample in rounds until a prompt's pool has signal, then train on a balanced group
(docs/methods.md#reinforce-ada).

Each round draws M rollouts for every still-active prompt. A rollout is positive iff its reward > τ. After the round
a prompt exits when its pool passes the exit test (`balanced`: ⌊n/2⌋ positives and n − ⌊n/2⌋ negatives;
`positive_focused`: one positive). Then every prompt keeps n rollouts of its pool, chosen in generation order
(`balanced_keep`), and each kept rollout gets the advantage r − mean(pool rewards), optionally divided by the
pool's std (`pool_advantages`).

Pure, vectorised over groups: rows are flat with a group index, in generation order.
"""

from __future__ import annotations

import torch

from podsrl.algo.advantages import grpo_advantages
from podsrl.algo.group_stats import group_outcomes

EXIT_RULES = ("balanced", "positive_focused")


def exit_test(positives: torch.Tensor, negatives: torch.Tensor, n: int, rule: str) -> torch.Tensor:
    """[P] bool: pools (counts of positives / negatives so far) that have enough signal to stop sampling."""
    if rule == "balanced":
        return (positives >= n // 2) & (negatives >= n - n // 2)
    if rule == "positive_focused":
        return positives >= 1
    raise ValueError(f"reinforce_ada.exit_rule: unknown {rule!r}; choose one of {', '.join(EXIT_RULES)}")


def keep_quotas(positives: torch.Tensor, negatives: torch.Tensor, resolved: torch.Tensor, n: int,
                rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """([P] positives kept, [P] negatives kept), together min(n, pool) per prompt.

    Balanced (exited prompts of either rule, and unresolved prompts under `balanced`): up to ⌊n/2⌋ positives, the
    rest negatives, topped up from whichever pool has more. Unresolved under `positive_focused`: the pool's
    positive share of n, rounded up and clamped to [1, take − 1], then topped up the same way.
    """
    pos, neg = positives.long(), negatives.long()
    take = (pos + neg).clamp(max=n)
    want_pos = torch.full_like(pos, n // 2)
    if rule == "positive_focused":
        pool = (pos + neg).clamp(min=1)
        share = (pos * n + pool - 1) // pool  # ⌈pos / pool · n⌉ in integers
        focused = torch.maximum(torch.minimum(share, take - 1), torch.ones_like(share))
        want_pos = torch.where(resolved, want_pos, focused)
    keep_pos = torch.minimum(want_pos, pos)
    keep_neg = torch.minimum(take - keep_pos, neg)
    short = take - keep_pos - keep_neg  # one pool ran out: the other fills the gap
    more_pos = torch.minimum(pos - keep_pos, short)
    keep_pos = keep_pos + more_pos
    keep_neg = keep_neg + torch.minimum(neg - keep_neg, short - more_pos)
    return keep_pos, keep_neg


def balanced_keep(positive: torch.Tensor, group_index: torch.Tensor, num_groups: int, resolved: torch.Tensor,
                  n: int, rule: str) -> torch.Tensor:
    """Row indices (ascending) kept from each prompt's pool: the first `keep_quotas` positives and negatives in
    generation order (row order)."""
    g = group_index.long()
    pos_flag = positive.bool()
    attempts, positives = group_outcomes(g, pos_flag, num_groups)
    keep_pos, keep_neg = keep_quotas(positives, attempts - positives, resolved, n, rule)
    quota = torch.stack([keep_neg, keep_pos], dim=1).reshape(-1)  # bucket 2g + positive
    bucket = 2 * g + pos_flag.long()
    order = torch.argsort(bucket, stable=True)  # buckets contiguous, generation order inside each
    sizes = torch.bincount(bucket, minlength=2 * num_groups)
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(order)
    rank[order] = torch.arange(g.numel()) - starts[bucket[order]]
    return (rank < quota[bucket]).nonzero().flatten()


def pool_advantages(kept_rewards: torch.Tensor, kept_group: torch.Tensor, pool_rewards: torch.Tensor,
                    pool_group: torch.Tensor, num_groups: int, std: bool = False,
                    epsilon: float = 1e-6) -> torch.Tensor:
    """[R_kept] A = r − mean(pool), or (r − mean) / (std + ε) with `std`; the pool is everything generated for the
    prompt this step. This is GRPO's advantage with group statistics over the pool; a constant pool gives exactly 0.
    A pool of one rollout has mean 0 and std 1, as in the reference, so its advantage is r. The reference also
    floors the std at ε, which only matters for pools GRPO already zeroes."""
    advantages = grpo_advantages(kept_rewards, kept_group, num_groups, "group" if std else "none", epsilon,
                                 pool_rewards, pool_group)
    single = torch.bincount(pool_group.long(), minlength=num_groups)[kept_group.long()] == 1
    return torch.where(single, kept_rewards.to(advantages.dtype), advantages)
