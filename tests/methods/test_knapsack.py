"""Knapsack-RL allocation (docs/methods.md#knapsack-rl): worked examples, the greedy solver against brute force,
invariants."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podsrl.algo.knapsack import (
    fallback_cost,
    greedy_allocation,
    knapsack_allocation,
    knapsack_value,
    marginal_gain,
    success_rate,
)
from podsrl.methods.knapsack import KnapsackConfig

_SOLVER_KEYS = ("min_n", "max_n", "negative_n", "positive_n", "alpha", "ref_quirks")


def allocate(rates, valid, n, budget, **overrides):
    """knapsack_allocation with the knapsack section's defaults for every option not given."""
    options = {key: getattr(KnapsackConfig(), key) for key in _SOLVER_KEYS} | overrides
    return knapsack_allocation(rates, valid, n, budget, **options)


def objective(rates, extra, min_n):
    return sum(knapsack_value(p, min_n + k) if k > 0 else 0.0 for p, k in zip(rates, extra))


def brute_force(rates, total, min_n, max_extra):
    """Best value over every split of `total` into len(rates) parts in [0, max_extra] (the reference's DP)."""
    best = -1.0
    for split in itertools.product(range(max_extra + 1), repeat=len(rates)):
        if sum(split) == total:
            best = max(best, objective(rates, split, min_n))
    return best


def test_value_and_gains_by_hand():
    # V(0.5, 5) = (1 - 2/32) * 0.5 * 0.25
    assert knapsack_value(0.5, 5) == pytest.approx((1 - 2 / 32) * 0.125)
    assert knapsack_value(0.0, 8) == 0.0 and knapsack_value(1.0, 8) == 0.0
    for p in (0.1, 0.25, 0.5, 0.9):
        assert marginal_gain(p, 2, 0) == pytest.approx(knapsack_value(p, 3))
        gains = [marginal_gain(p, 2, k) for k in range(12)]
        for k in range(1, 12):  # closed form equals the difference of values
            assert gains[k] == pytest.approx(knapsack_value(p, 3 + k) - knapsack_value(p, 2 + k), abs=1e-15)
        assert all(a >= b for a, b in zip(gains, gains[1:])), "concavity: gains fall with k"


def test_spec_example_best_split():
    # p = 0.5 and 0.25, r = 8, k <= 6: (3, 5) is worth 0.23903, (4, 4) 0.23666, (2, 6) 0.23592
    rates = [0.5, 0.25]
    assert objective(rates, (3, 5), 2) == pytest.approx(0.23903, abs=5e-6)
    assert objective(rates, (4, 4), 2) == pytest.approx(0.23666, abs=5e-6)
    assert objective(rates, (2, 6), 2) == pytest.approx(0.23592, abs=5e-6)
    assert greedy_allocation(rates, 8, 2, 6) == [3, 5]


def test_spec_examples_allocation():
    n, budget = 4, 16
    kw = dict(min_n=2, max_n=8, negative_n=2, positive_n=2)
    out = allocate([1, 0, 0.5, 0.25], [True] * 4, n, budget, **kw)
    assert out.counts == [2, 2, 5, 7]
    assert not out.fallback and out.fallback_effective_ratio == 1.0 and out.leftover == 0
    # costs 3.32 and 8.00 give E = 11 >= r = 8
    assert fallback_cost(0.5, 0.9) == pytest.approx(3.3219, abs=1e-4)
    assert fallback_cost(0.25, 0.9) == pytest.approx(8.0039, abs=1e-4)
    # a new (invalid) prompt: initial [4, 2, 2, 2], r = 6, E = 3 -> fallback
    ours = allocate([0, 1, 0.5, 0], [False, True, True, True], n, budget, **kw)
    ref = allocate([0, 1, 0.5, 0], [False, True, True, True], n, budget, ref_quirks=True, **kw)
    assert ours.counts == [4, 2, 5, 5]
    assert ref.counts == [6, 2, 5, 3]
    assert ours.fallback and ours.fallback_effective_ratio == pytest.approx(3 / 6)
    # no effective prompt: the rest goes to the p = 0 prompts; with none, everyone gets n
    assert allocate([1, 0, 0, 1], [True] * 4, n, budget, **kw).counts == [2, 6, 6, 2]
    assert allocate([1, 1], [True] * 2, n, 8, **kw).counts == [4, 4]


def test_no_history_gets_n_everywhere():
    out = allocate([0.0] * 5, [False] * 5, 8, 40)
    assert out.counts == [8] * 5 and not out.fallback


def test_fallback_with_only_effective_prompts_keeps_the_budget():
    # every prompt effective and easy to resolve: E < r but there is nowhere else to put it (the reference divides
    # by zero here); the solver places all of r within max_n
    out = allocate([0.5, 0.5], [True, True], 8, 16, max_n=16)
    assert sum(out.counts) == 16 and not out.fallback and max(out.counts) <= 16


def test_leftover_beyond_max_n_goes_to_unsolved_prompts():
    # one effective prompt can hold max_n - min_n = 4 of r = 6; its need (cost capped at max_n = 6) is not below r,
    # so no fallback. The other 2 go to the p = 0 prompt (ours) or past the cap on the effective prompt (reference).
    kw = dict(min_n=2, max_n=6, alpha=0.999999)
    ours = allocate([0.5, 0.0, 1.0], [True] * 3, 4, 12, **kw)
    assert ours.counts == [6, 4, 2] and ours.leftover == 2 and not ours.fallback
    ref = allocate([0.5, 0.0, 1.0], [True] * 3, 4, 12, ref_quirks=True, **kw)
    assert ref.counts == [8, 2, 2]


def test_capped_fallback_passes_the_rest_on():
    # fallback surplus 6 for one p = 0 prompt that can hold 4 more (max_n 6): the rest returns to the solver
    # and what the effective prompt cannot hold goes to the last prompt; no count passes max_n
    out = allocate([0.5, 0.0, 1.0], [True] * 3, 6, 18, min_n=2, max_n=6, alpha=0.999999)
    assert out.fallback and out.counts == [6, 6, 6]


def test_success_rate_window():
    assert success_rate(0, 0, [], 16) == 0.0
    assert success_rate(3, 4, [True, False, True, True], 16) == 0.75
    # a visit of >= 16 rollouts stands alone
    assert success_rate(4, 16, [True] * 16, 16) == 0.25
    # fewer: the 16 newest outcomes across visits
    ring = [False] * 10 + [True] * 8
    assert success_rate(8, 8, ring, 16) == pytest.approx(8 / 16)


@settings(max_examples=150, deadline=None)
@given(rates=st.lists(st.sampled_from([0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 0.6, 0.75, 0.9, 0.97]), min_size=1,
                      max_size=4),
       total=st.integers(0, 20), max_extra=st.integers(0, 6), min_n=st.integers(1, 4))
def test_greedy_is_exact_against_brute_force(rates, total, max_extra, min_n):
    feasible = min(total, len(rates) * max_extra)
    extra = greedy_allocation(rates, total, min_n, max_extra)
    assert sum(extra) == feasible and all(0 <= k <= max_extra for k in extra)
    assert objective(rates, extra, min_n) == pytest.approx(brute_force(rates, feasible, min_n, max_extra),
                                                           rel=1e-12, abs=1e-15)


def test_greedy_ties_to_lower_index():
    assert greedy_allocation([0.5, 0.5, 0.5], 1, 2, 4) == [1, 0, 0]
    assert greedy_allocation([0.5, 0.5, 0.5], 4, 2, 4) == [2, 1, 1]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), num=st.integers(1, 12), n=st.integers(2, 16), ref=st.booleans())
def test_allocation_invariants(data, num, n, ref):
    min_n = data.draw(st.integers(1, n))
    max_n = data.draw(st.integers(n, 4 * n))
    rate = st.one_of(st.just(0.0), st.just(1.0), st.floats(0.01, 0.99))
    rates = data.draw(st.lists(rate, min_size=num, max_size=num))
    valid = data.draw(st.lists(st.booleans(), min_size=num, max_size=num))
    out = allocate(rates, valid, n, num * n, min_n=min_n, max_n=max_n, negative_n=min_n,
                              positive_n=min_n, ref_quirks=ref)
    assert sum(out.counts) == num * n
    assert min(out.counts) >= min_n
    if not ref:
        assert max(out.counts) <= max_n
    for i in range(num):
        if not valid[i] and not ref:
            assert out.counts[i] >= n
    assert 0.0 <= out.fallback_effective_ratio <= 1.0
    # deterministic: a pure function of its inputs
    again = allocate(rates, valid, n, num * n, min_n=min_n, max_n=max_n, negative_n=min_n,
                                positive_n=min_n, ref_quirks=ref)
    assert again.counts == out.counts


def test_effective_prompts_get_the_optimum_of_what_they_receive():
    rates = [0.5, 0.1, 0.9, 0.3, 0.0, 1.0]
    out = allocate(rates, [True] * 6, 8, 48, min_n=2, max_n=16, alpha=0.999999)
    eff = [0, 1, 2, 3]
    extra = [out.counts[i] - 2 for i in eff]
    placed = sum(extra)
    best = brute_force([rates[i] for i in eff], placed, 2, 14)
    assert objective([rates[i] for i in eff], extra, 2) == pytest.approx(best)
    assert math.isclose(sum(out.counts), 48)


# ------------------------------------------------------------------------------------------ the method


def knapsack_config(**overrides):
    from podsrl.methods.knapsack import Knapsack
    from tests.method_helpers import method_config

    return method_config(Knapsack, "rollout.n=4", "knapsack.max_n=8", *[f"{k}={v}" for k, v in overrides.items()])


def test_method_allocation_from_prompt_stats():
    import torch

    from podsrl.methods.knapsack import Knapsack
    from tests.method_helpers import ScriptedContext, problems

    cfg = knapsack_config()
    ctx = ScriptedContext(cfg, lambda uid, k: True)
    rates = {"p0": [True] * 8, "p1": [False] * 8, "p2": [True, False] * 4, "p3": [True, False, False, False] * 2}
    for uid, bits in rates.items():
        ctx.stats.record([uid], torch.zeros(8, dtype=torch.long), torch.tensor(bits))
    method = Knapsack(cfg)
    batch, metrics = method.collect(problems(4) + problems(1, start=9), ctx)
    # p9 is new (gets n = 4); the other four are the spec's [1, 0, 0.5, 0.25] with B = 20 - 4 = 16 for them
    assert ctx.calls[0][1] == [2, 2, 5, 7, 4]
    assert metrics["allocation/max_budget"] == 7 and metrics["allocation/min_budget"] == 2
    assert metrics["allocation/budget_fallback"] == 0.0 and metrics["allocation/covered_prompts"] == 5
    kept, more = method.select(batch, ctx)
    assert kept.num_rollouts == 20 and kept.advantages is not None
    assert 0 <= more["training/effective_gradient_ratio"] <= 1


def test_method_rate_uses_the_newest_window():
    import torch

    from podsrl.methods.knapsack import Knapsack
    from tests.method_helpers import ScriptedContext, problems

    cfg = knapsack_config(**{"knapsack.min_history": 4})
    ctx = ScriptedContext(cfg, lambda uid, k: True)
    # 12 failures then 4 successes for p0: the 16 newest give 0.25; p1's last visit has 16 rollouts, all correct
    for bits in ([False] * 12, [True] * 4):
        ctx.stats.record(["p0"], torch.zeros(len(bits), dtype=torch.long), torch.tensor(bits))
    for bits in ([False] * 16, [True] * 16):
        ctx.stats.record(["p1"], torch.zeros(16, dtype=torch.long), torch.tensor(bits))
    counts, _ = Knapsack(cfg).allocate(problems(2), ctx)
    assert counts == [6, 2]  # p1 (p = 1) gets positive_n, p0 takes the rest of B = 8


def test_effectiveness_metrics_by_hand():
    from podsrl.methods.knapsack import effectiveness_metrics
    from tests.method_helpers import problems, scored_batch

    bits = [True] * 4 + [True, True, True, False, True] + [True, False] + [False] * 3
    batch = scored_batch(problems(4), [0, 1, 2, 3], [4, 5, 2, 3], bits)
    m = effectiveness_metrics(batch)
    assert m["training/effective_prompt_ratio"] == 0.5
    assert m["training/effective_gradient_ratio"] == 7 / 14
    assert m["prompt/extremely_easy_ratio"] == 0.25 and m["prompt/easy_ratio"] == 0.25
    assert m["prompt/medium_ratio"] == 0.25 and m["prompt/extremely_hard_ratio"] == 0.25
    assert m["prompt/hard_ratio"] == 0.0


def test_method_config_errors():
    from podsrl.errors import ConfigError

    with pytest.raises(ConfigError, match="knapsack.max_n"):
        knapsack_config(**{"knapsack.max_n": 2})
    with pytest.raises(ConfigError, match="knapsack.min_n"):
        knapsack_config(**{"knapsack.min_n": 5})
    with pytest.raises(ConfigError, match="knapsack.window"):
        knapsack_config(**{"knapsack.window": 17})


def test_trains_end_to_end(tmp_path, warmup_cache):
    from tests.method_helpers import train_preset

    steps = train_preset("knapsack", tmp_path / "run", warmup_cache, **{"knapsack.min_history": 4,
                                                                         "knapsack.max_n": 12})
    assert len(steps) == 6
    for r in steps:
        assert r["rollouts/generated"] == r["rollouts/trained"] == 16  # the budget, every rollout trains
        assert 2 <= r["allocation/min_budget"] <= 4 <= r["allocation/max_budget"] <= 12
        assert 0 <= r["training/effective_gradient_ratio"] <= 1
    assert steps[0]["allocation/max_budget"] == steps[0]["allocation/min_budget"] == 4, "no history: n each"
    assert any(r["allocation/max_budget"] > r["allocation/min_budget"] for r in steps[2:]), "history reallocates"
