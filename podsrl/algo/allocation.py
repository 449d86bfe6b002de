"""How many rollouts each prompt of a step gets (docs/methods.md#dynamo, DynaMO sequence-level allocation).

Under a fixed step budget B = Σ n_i, the gradient-estimate variance is minimised by n_i ∝ σ_i. σ_i is
proxied from each prompt's run-long success history (successes k_i out of G_i attempts, see
`PromptStats.counts`).

Pipeline of `allocate_by_variance`:
  1. priorities from histories (`variance_priority`); prompts with too little history are "unknown";
  2. base counts: with `unknown_rule="reference"` (the reference code) every prompt gets max(n_min, min_history) − G_i
     (the rollouts it still needs to become known), at least n_min; with `"rollout_n"` unknown prompts get the
     exploration count (rollout.n) and everyone else n_min (all clipped to [n_min, n_max]);
  3. the rest of the budget is water-filled in proportion to priority (`water_fill`), capped at n_max;
  4. repair so that Σ n_i = B exactly (`_level_down` / `_level_up`).

Every function here is pure (no state) and works on 1-D tensors of length P (prompts of the step).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_history(successes: Tensor, attempts: Tensor) -> tuple[Tensor, Tensor]:
    k, g = torch.as_tensor(successes).long(), torch.as_tensor(attempts).long()
    if k.dim() != 1 or k.shape != g.shape:
        raise ValueError(f"successes {tuple(k.shape)} and attempts {tuple(g.shape)} must be equal 1-D shapes")
    if bool(((k < 0) | (k > g)).any()):
        raise ValueError("successes must lie in [0, attempts] for every prompt")
    return k, g


def variance_priority(
    successes: Tensor,
    attempts: Tensor,
    min_history: int,
    mastered_rate: float,
    floor: float,
    weight: str,
) -> tuple[Tensor, Tensor]:
    """Per-prompt priority from the unbiased Bernoulli variance V = k(G−k)/(G(G−1)).

    Returns (priority [P] float64, unknown [P] bool). Unknown prompts (G < min_history) get priority 0:
    their share is the exploration count, not a water-filling weight. Mastered prompts (k/G ≥
    mastered_rate) get `floor`; the rest get max(w, floor) with w = V (`weight="variance"`, the
    reference code) or √V (`"std"`, the theorem's n ∝ σ). The floor is in priority units for both
    weightings, so "floor" always means the smallest share a known prompt has.
    """
    k, g = _check_history(successes, attempts)
    kf, gf = k.double(), g.double()
    unknown = g < max(int(min_history), 1)
    # G(G−1) is 0 for G ≤ 1; the numerator k(G−k) is 0 there too, so V = 0 (such prompts are unknown by
    # default anyway).
    variance = kf * (gf - kf) / (gf * (gf - 1.0)).clamp(min=1.0)
    w = variance.sqrt() if weight == "std" else variance
    rate = kf / gf.clamp(min=1.0)
    priority = torch.where(rate >= mastered_rate, torch.full_like(w, floor), w.clamp(min=floor))
    priority = torch.where(unknown, torch.zeros_like(priority), priority)
    return priority, unknown


def _pick(candidates: Tensor, count: int, key: Tensor) -> Tensor:
    """Bool mask of the first `count` candidates ordered by descending key, ties broken by index (stable)."""
    order = torch.sort(torch.where(candidates, key, -torch.inf), descending=True, stable=True).indices
    chosen = torch.zeros_like(candidates)
    chosen[order[:count]] = True
    return chosen & candidates


def _level_up(counts: Tensor, cap: Tensor, target: int, priority: Tensor) -> Tensor:
    """Raise the lowest counts first (round-robin from the bottom) until Σ = target, never above cap.

    Finds the largest level L with Σ min(cap, max(c, L)) ≤ target, then hands the few units still
    missing to the prompts sitting exactly at L, highest priority first. Requires Σ cap ≥ target.
    """

    def filled(level: int) -> Tensor:
        return torch.minimum(cap, counts.clamp(min=level))

    lo, hi = (
        int(counts.min()),
        int(cap.max()),
    )  # filled(lo) = counts (Σ ≤ target); filled(hi) = cap (Σ ≥ target)
    while lo < hi:  # binary search for the largest level whose fill does not exceed the target
        mid = (lo + hi + 1) // 2
        if int(filled(mid).sum()) <= target:
            lo = mid
        else:
            hi = mid - 1
    out = filled(lo)
    missing = target - int(out.sum())
    if missing > 0:  # prompts that would grow at level lo+1: c ≤ lo < cap
        out = out + _pick((counts <= lo) & (cap > lo), missing, priority).long()
    return out


def _level_down(counts: Tensor, floor: Tensor, target: int, priority: Tensor) -> Tensor:
    """Cut the highest counts first until Σ = target, never below floor (lowest priority loses the last
    units, ties by index)."""

    def cut(level: int) -> Tensor:
        return torch.maximum(floor, counts.clamp(max=level))

    lo, hi = (
        int(floor.min()),
        int(counts.max()),
    )  # cut(lo) = floor (Σ ≤ target); cut(hi) = counts (Σ ≥ target)
    while lo < hi:  # binary search for the smallest level whose cut still reaches the target
        mid = (lo + hi) // 2
        if int(cut(mid).sum()) >= target:
            hi = mid
        else:
            lo = mid + 1
    out = cut(lo)
    excess = int(out.sum()) - target
    if excess > 0:  # prompts that would shrink at level lo−1: c ≥ lo > floor
        out = out - _pick((counts >= lo) & (floor < lo), excess, -priority).long()
    return out


def water_fill(base: Tensor, priority: Tensor, budget: int, n_max: int) -> Tensor:
    """Add budget − Σ base to `base` in proportion to `priority`, capped at n_max; Σ of the result = budget.

    Each round gives every eligible prompt (below the cap, priority > 0) floor(R·w_i/Σw) plus one more
    for the largest fractional parts, clips at the cap, and re-runs on what the cap freed. Each round
    either finishes or caps at least one prompt, so there are at most P rounds. When no prompt with
    positive priority has room, the rest goes round-robin to the lowest counts. Requires Σ base ≤ budget
    ≤ P·n_max.
    """
    counts = base.long().clone()
    prio = priority.double()
    cap = torch.full_like(counts, int(n_max))
    remaining = int(budget) - int(counts.sum())
    for _ in range(counts.numel() + 1):
        eligible = (counts < cap) & (prio > 0)
        if remaining <= 0 or not bool(eligible.any()):
            break
        w = torch.where(eligible, prio, torch.zeros_like(prio))
        share = remaining * w / w.sum()
        add = share.floor().long()
        leftover = min(remaining - int(add.sum()), int(eligible.sum()))
        if leftover > 0:
            add = add + _pick(eligible, leftover, share - add.double()).long()
        add = torch.minimum(add, cap - counts)
        counts += add
        remaining -= int(add.sum())
    if remaining > 0:
        counts = _level_up(counts, cap, int(budget), prio)
    return counts


def allocate_by_variance(
    successes: Tensor,
    attempts: Tensor,
    budget: int,
    n_min: int,
    n_max: int,
    explore: int,
    unknown_rule: str,
    min_history: int,
    **priority_kwargs,
) -> Tensor:
    """DynaMO rollout counts [P] long with n_min ≤ n_i ≤ n_max and Σ n_i = budget exactly.

    Base counts: `unknown_rule="reference"` gives each prompt clip(max(n_min, min_history) − G_i, n_min, n_max) with
    G_i its attempts so far (so with n_min ≥ min_history every prompt starts at n_min, and unknown prompts, whose
    priority is 0, get no share of the rest); `"rollout_n"` gives unknown prompts clip(explore, n_min, n_max) and the
    others n_min. Base counts that alone overrun the budget are cut evenly from the top (ties by index); the
    remainder is water-filled by priority. Needs 1 ≤ n_min and P·n_min ≤ budget ≤ P·n_max, which the dynamo section's
    checks guarantee (n_min ≤ rollout.n ≤ n_max, methods/dynamo.py).
    """
    budget, n_min, n_max, explore = int(budget), int(n_min), int(n_max), int(explore)
    priority, unknown = variance_priority(successes, attempts, min_history=min_history, **priority_kwargs)
    num_prompts = priority.numel()
    if num_prompts == 0:
        return torch.zeros(0, dtype=torch.long)
    if unknown_rule == "reference":
        needed = max(n_min, int(min_history)) - torch.as_tensor(attempts).long()
        base = needed.clamp(min=n_min, max=n_max)
    else:
        base = torch.where(unknown, min(max(explore, n_min), n_max), n_min).long()
    counts = water_fill(base, priority, budget, n_max)  # returns `base` unchanged when the explorers overrun
    # Repair to Σ = budget: an overrun by the explorers is cut from the top (highest counts first, never below
    # n_min); a shortfall (only possible through float rounding of the shares) is filled from the bottom.
    total = int(counts.sum())
    if total > budget:
        counts = _level_down(counts, torch.full_like(counts, n_min), budget, priority)
    elif total < budget:
        counts = _level_up(counts, torch.full_like(counts, n_max), budget, priority)
    return counts


def allocation_metrics(
    counts: Tensor, successes: Tensor, attempts: Tensor, min_history: int, mastered_rate: float
) -> dict[str, float]:
    """Step metrics: spread of the counts, budget share of mastered prompts, fraction of unknown prompts."""
    k, g = _check_history(successes, attempts)
    c = torch.as_tensor(counts).long()
    if c.numel() == 0:
        return {}
    unknown = g < max(int(min_history), 1)
    mastered = ~unknown & (k.double() >= mastered_rate * g.double())
    total = max(int(c.sum()), 1)
    return {
        "alloc/n_min": float(c.min()),
        "alloc/n_mean": float(c.double().mean()),
        "alloc/n_max": float(c.max()),
        "alloc/frac_budget_mastered": float(c[mastered].sum()) / total,
        "alloc/frac_unknown": float(unknown.double().mean()),
    }

