"""Knapsack-RL: a step's rollout budget split over prompts as a knapsack (docs/methods.md#knapsack-rl).

Each prompt i with estimated success rate p_i is worth V(p, N) = (1 − p^N − (1−p)^N) · p(1−p)² when given N
rollouts: the chance that its group has both outcomes (a non-zero gradient) times an information gain. Under
Σ n_i = B, the "effective" prompts (0 < p < 1) start at min_n and the solver hands out the rest; prompts with
p = 0 / p = 1 get negative_n / positive_n and prompts with too little history get n.

The reference solves the allocation by dynamic programming over (prompt, budget, extra rollouts), O(P·B·max_n).
The objective is separable and each prompt's value is concave in its extra rollouts k (the first unit is worth
V(p, min_n + 1), later units p(1−p)²·[p^N(1−p) + (1−p)^N·p], which falls with N), so handing out the budget one
unit at a time to the largest marginal gain is exact: `greedy_allocation`, O(B log P), ties to the lower index.

Everything here is pure: plain floats and lists, no state.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass


def knapsack_value(p: float, n: int) -> float:
    """V(p, N): P(the group of N rollouts has a success and a failure) × p(1−p)²."""
    q = 1.0 - p
    return (1.0 - p**n - q**n) * p * q * q


def marginal_gain(p: float, min_n: int, k: int) -> float:
    """Value of the (k+1)-th extra rollout of a prompt that already holds min_n + k (the first is V(p, min_n + 1))."""
    q = 1.0 - p
    if k == 0:
        return knapsack_value(p, min_n + 1)
    n = min_n + k  # V(p, n+1) − V(p, n) in closed form: no cancellation between close values
    return p * q * q * (p**n * q + q**n * p)


def greedy_allocation(rates: Sequence[float], total: int, min_n: int, max_extra: int) -> list[int]:
    """Extra rollouts k_i in [0, max_extra] with Σ k_i = min(total, len·max_extra), maximising
    Σ [k_i > 0] · V(p_i, min_n + k_i). Exact because every prompt's value is concave in k; equal gains go to
    the lower index."""
    extra = [0] * len(rates)
    if max_extra <= 0:
        return extra
    heap = [(-marginal_gain(p, min_n, 0), i) for i, p in enumerate(rates)]
    heapq.heapify(heap)
    for _ in range(min(int(total), len(rates) * max_extra)):
        _, i = heapq.heappop(heap)
        extra[i] += 1
        if extra[i] < max_extra:
            heapq.heappush(heap, (-marginal_gain(rates[i], min_n, extra[i]), i))
    return extra


def success_rate(last_successes: int, last_attempts: int, recent: Sequence[bool], window: int) -> float:
    """p̂: the last visit's success rate if that visit had ≥ `window` rollouts, else the mean of the newest
    `window` outcomes across visits (`recent`, oldest first). 0 for a prompt never seen."""
    if last_attempts >= window:
        return last_successes / last_attempts
    newest = list(recent)[-window:]
    return sum(newest) / len(newest) if newest else 0.0


def fallback_cost(p: float, alpha: float) -> float:
    """Rollouts needed to see the rarer outcome of an effective prompt with probability α."""
    return math.log(1.0 - alpha) / math.log(max(p, 1.0 - p))


@dataclass
class KnapsackResult:
    counts: list[int]  # rollouts per prompt, Σ = budget
    fallback: bool  # the effective prompts' estimated need was below the budget; the surplus went elsewhere
    fallback_effective_ratio: float  # that need / the budget left after the initial allocation (1 without fallback)
    leftover: int  # budget the effective prompts could not hold within max_n (placed by the leftover rule)


def _spread(counts: list[int], recipients: Sequence[int], amount: int, cap: int | None) -> int:
    """Split `amount` evenly over `recipients` (the lowest indices take the remainder), never above `cap`;
    what capped prompts cannot hold is split again over the others. Returns what no recipient could hold."""
    room = [i for i in recipients if cap is None or counts[i] < cap]
    while amount > 0 and room:
        share, remainder = divmod(amount, len(room))
        for j, i in enumerate(room):
            give = share + (1 if j < remainder else 0)
            if cap is not None:
                give = min(give, cap - counts[i])
            counts[i] += give
            amount -= give
        room = [i for i in room if cap is None or counts[i] < cap]
    return amount


def knapsack_allocation(
    rates: Sequence[float],
    valid: Sequence[bool],
    n: int,
    budget: int,
    *,
    min_n: int,
    max_n: int,
    negative_n: int,
    positive_n: int,
    alpha: float,
    ref_quirks: bool,
) -> KnapsackResult:
    """Rollouts per prompt with Σ = budget (docs/methods.md#knapsack-rl).

    - Initial: an invalid prompt (too little history) gets n; effective (0 < p̂ < 1) min_n; p̂ = 0 negative_n;
      p̂ = 1 positive_n. r = budget − Σ initial.
    - No effective prompt: r goes evenly to the p̂ = 0 prompts; with none, every prompt gets n.
    - Fallback: if the effective prompts' need E = Σ int(min(max_n, cost_i)) is below r, r − E goes evenly to the
      p̂ = 0 prompts (with none, to every non-effective prompt) and only E is solved for.
    - Solve: `greedy_allocation` of r over the effective prompts, each at most max_n. Budget the effective prompts
      cannot hold within max_n goes evenly to the p̂ = 0 prompts, else to the other non-effective prompts.

    Our choice (`ref_quirks=False`): invalid prompts are not "p̂ = 0" prompts, and no prompt exceeds max_n (a capped prompt's
    share passes to the others). `ref_quirks=True` reproduces the reference: invalid prompts count as p̂ = 0 (their
    stored rate is 0), splits are uncapped, and leftover budget is spread over the effective prompts beyond max_n.
    """
    num = len(rates)
    if len(valid) != num:
        raise ValueError(f"rates ({num}) and valid ({len(valid)}) must have one entry per prompt")
    effective = [i for i in range(num) if valid[i] and 0.0 < rates[i] < 1.0]
    zero = [i for i in range(num) if (valid[i] and rates[i] == 0.0) or (ref_quirks and not valid[i])]
    non_effective = [i for i in range(num) if i not in set(effective)]
    counts = [
        n if not valid[i] else min_n if 0.0 < rates[i] < 1.0 else negative_n if rates[i] == 0.0 else positive_n
        for i in range(num)
    ]
    remaining = budget - sum(counts)
    if remaining < 0:
        raise ValueError(f"the initial allocation {sum(counts)} exceeds the budget {budget}")
    cap = None if ref_quirks else max_n
    result = KnapsackResult(counts, fallback=False, fallback_effective_ratio=1.0, leftover=0)
    if not effective:
        if remaining > 0:
            if zero:
                remaining = _spread(counts, zero, remaining, cap)
                remaining = _spread(counts, range(num), remaining, cap)  # every p̂ = 0 prompt at max_n
            else:
                result.counts = counts = [n] * num
                remaining = 0
        assert remaining == 0 and sum(counts) == budget, "Knapsack allocation lost budget"
        return result
    need = sum(int(min(max_n, fallback_cost(rates[i], alpha))) for i in effective)
    targets = zero or non_effective
    if need < remaining and targets:
        result.fallback, result.fallback_effective_ratio = True, need / remaining
        surplus = _spread(counts, targets, remaining - need, cap)
        remaining = need + surplus  # a surplus no target could hold goes back to the solver
    extra = greedy_allocation([rates[i] for i in effective], remaining, min_n, max_n - min_n)
    for i, k in zip(effective, extra):
        counts[i] += k
    leftover = remaining - sum(extra)
    result.leftover = leftover
    if leftover > 0:
        if ref_quirks:
            leftover = _spread(counts, effective, leftover, None)
        else:
            for group in (zero, non_effective, range(num)):
                leftover = _spread(counts, group, leftover, cap)
    assert leftover == 0 and sum(counts) == budget, "Knapsack allocation lost budget"
    return result
