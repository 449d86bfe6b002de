import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from podsrl.algo import allocation
from podsrl.algo.allocation import water_fill
from podsrl.config import load_config
from podsrl.errors import ConfigError
from podsrl.methods.dynamo import DynamoConfig

# the kernels take every setting; a test's unnamed ones are the dynamo section's defaults
SETTINGS = {k: getattr(DynamoConfig(), k) for k in ("min_history", "mastered_rate", "floor", "weight")}


def variance_priority(successes, attempts, **settings):
    return allocation.variance_priority(successes, attempts, **{**SETTINGS, **settings})


def allocate_by_variance(*counts_and_bounds, **settings):
    return allocation.allocate_by_variance(*counts_and_bounds,
                                           **{"unknown_rule": DynamoConfig().unknown_rule, **SETTINGS, **settings})


def allocation_metrics(counts, successes, attempts):
    return allocation.allocation_metrics(counts, successes, attempts, min_history=SETTINGS["min_history"],
                                         mastered_rate=SETTINGS["mastered_rate"])


def t(xs):
    return torch.tensor(xs, dtype=torch.long)


def hamilton(base, weights, budget):
    """Largest-remainder apportionment of budget − Σ base by weights, written as a plain loop (no caps)."""
    extra = budget - sum(base)
    total = sum(weights)
    shares = [extra * w / total for w in weights]
    add = [math.floor(s) for s in shares]
    order = sorted(range(len(base)), key=lambda i: (-(shares[i] - add[i]), i))
    for i in order[: extra - sum(add)]:
        add[i] += 1
    return [b + a for b, a in zip(base, add)]


def test_variance_priority_hand_values():
    k, g = t([0, 5, 2, 9, 0, 3, 1]), t([0, 10, 10, 10, 10, 3, 2])
    prio, unknown = variance_priority(k, g)
    assert unknown.tolist() == [True, False, False, False, False, True, True]
    # V = k(G−k)/(G(G−1)): 25/90, 16/90; 9/10 ≥ 0.85 is mastered; k = 0 has V = 0 -> floor
    assert prio.tolist() == pytest.approx([0.0, 25 / 90, 16 / 90, 0.01, 0.01, 0.0, 0.0])
    prio_std, _ = variance_priority(k, g, weight="std")
    assert prio_std.tolist() == pytest.approx(
        [0.0, math.sqrt(25 / 90), math.sqrt(16 / 90), 0.01, 0.01, 0.0, 0.0]
    )
    # min_history and the mastered threshold are parameters
    prio2, unknown2 = variance_priority(t([2, 8]), t([3, 10]), min_history=2, mastered_rate=0.9, floor=0.05)
    assert not unknown2.any()
    assert prio2.tolist() == pytest.approx([2 / 6, max(16 / 90, 0.05)])
    with pytest.raises(ConfigError, match="dynamo.weight"):  # the choices are the section's, checked at load
        load_config(None, ["method=dynamo", "dynamo.weight=sigma"])


def test_water_fill_proportional_away_from_bounds():
    out = water_fill(t([8, 8, 8]), torch.tensor([1.0, 2.0, 3.0]), budget=24 + 60, n_max=100)
    assert out.tolist() == [18, 28, 38]
    # a cap frees budget that is re-split among the others in proportion to their weights
    out = water_fill(t([0, 0, 0]), torch.tensor([1.0, 1.0, 8.0]), budget=30, n_max=12)
    assert out.tolist() == [9, 9, 12]
    out = water_fill(t([0, 0, 0]), torch.tensor([1.0, 3.0, 12.0]), budget=30, n_max=12)
    assert out.tolist() == [6, 12, 12]  # 12 capped, then 3 capped, the last gets what remains


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0.0, 5.0), min_size=1, max_size=30), st.integers(0, 400), st.integers(0, 6))
def test_water_fill_matches_largest_remainder_without_caps(weights, extra, base_n):
    base = [base_n] * len(weights)
    if sum(weights) <= 0:
        weights = [0.0] * len(weights)
    out = water_fill(t(base), torch.tensor(weights, dtype=torch.float64), sum(base) + extra, n_max=10_000)
    assert int(out.sum()) == sum(base) + extra
    if sum(weights) > 0:
        assert out.tolist() == hamilton(base, weights, sum(base) + extra)
    else:  # round-robin: as even as possible
        assert int(out.max() - out.min()) <= 1


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 10),
    st.integers(0, 20),
    st.integers(0, 40),
    st.floats(0.0, 1.0),
    st.sampled_from(["variance", "std"]),
    st.sampled_from([0.0, 0.01]),
    st.integers(0, 2**31 - 1),
)
def test_allocation_sums_to_budget_within_bounds(p, n_min, spread, explore, frac, weight, floor, seed):
    gen = random.Random(seed)
    n_max = n_min + spread
    budget = p * n_min + round(frac * p * spread)
    attempts = [gen.choice([0, 1, 2, 3, 4, 8, 16, 50]) for _ in range(p)]
    successes = [gen.randint(0, a) for a in attempts]
    out = allocate_by_variance(
        t(successes), t(attempts), budget, n_min, n_max, explore, weight=weight, floor=floor
    )
    assert out.dtype == torch.long and out.shape == (p,)
    assert int(out.sum()) == budget
    assert int(out.min()) >= n_min and int(out.max()) <= n_max
    again = allocate_by_variance(
        t(successes), t(attempts), budget, n_min, n_max, explore, weight=weight, floor=floor
    )
    assert torch.equal(out, again)


def test_all_zero_priorities_round_robin():
    # floor 0 and every known prompt all-wrong: no positive priority, the budget is spread evenly
    k, g = torch.zeros(5, dtype=torch.long), t([8] * 5)
    out = allocate_by_variance(k, g, budget=5 * 8 + 13, n_min=8, n_max=24, explore=16, floor=0.0)
    assert out.tolist() == [11, 11, 11, 10, 10]


def test_all_unknown_prompts_rollout_n_rule():
    def allocate(*args, **kw):
        return allocate_by_variance(*args, unknown_rule="rollout_n", **kw)

    k = g = torch.zeros(6, dtype=torch.long)
    assert allocate(k, g, 96, 8, 24, explore=16).tolist() == [16] * 6
    # explorers overrun the budget: cut evenly from the top, never below n_min
    out = allocate(k, g, 6 * 8 + 9, 8, 24, explore=20)
    assert out.tolist() == [9, 9, 9, 10, 10, 10]
    # mixed: the known prompts keep n_min, only the explorers are cut
    out = allocate(t([0, 5, 0, 9]), t([0, 10, 1, 10]), 8 + 8 + 2 * 11, 8, 24, explore=20)
    assert out.tolist() == [11, 8, 11, 8]
    # explorers leave budget over and nobody has a priority: spread evenly, capped at n_max
    out = allocate(k, g, 6 * 23, 8, 24, explore=12)
    assert out.tolist() == [23] * 6
    # exploration count is clipped to the bounds
    assert allocate(k[:2], g[:2], 16, 8, 24, explore=2).tolist() == [8, 8]


def test_rollout_n_rule_unknown_get_exploration_count_and_known_share_the_rest():
    k, g = t([0, 5, 2, 0]), t([0, 10, 10, 1])
    out = allocate_by_variance(k, g, budget=12 + 8 + 8 + 12 + 30, n_min=8, n_max=100, explore=12,
                               unknown_rule="rollout_n")
    # unknowns (G < 4) get exactly 12; the 30 extra go 25:16 to the known prompts
    assert out.tolist() == [12] + hamilton([8, 8], [25 / 90, 16 / 90], 46) + [12]


def test_reference_rule_mixed_batch_worked_example():
    # 4 unknown + 4 known prompts, n = 16, bounds [8, 24]. The reference code starts every prompt at
    # max(n_min, min_history) - G = 8 and water-fills the rest to the known prompts by priority (unknown priority
    # is 0); the rollout_n rule gives each unknown prompt rollout.n = 16 and leaves the known ones the remainder.
    k, g = t([0, 0, 0, 0, 8, 6, 12, 14]), t([0, 0, 0, 0, 16, 16, 16, 16])
    reference = allocate_by_variance(k, g, budget=8 * 16, n_min=8, n_max=24, explore=16)
    assert reference.tolist() == [8, 8, 8, 8, 24, 24, 24, 24]
    ours = allocate_by_variance(k, g, budget=8 * 16, n_min=8, n_max=24, explore=16, unknown_rule="rollout_n")
    priority = [8 * 8 / 240, 6 * 10 / 240, 12 * 4 / 240, 0.01]  # V = k(G-k)/(G(G-1)); 14/16 is mastered
    assert ours.tolist() == [16] * 4 + hamilton([8] * 4, priority, 128 - 4 * 16) == [16] * 4 + [20, 19, 17, 8]


def test_reference_rule_counts_the_history_an_unknown_prompt_still_needs():
    # n_min below min_history: an unknown prompt with G attempts starts at min_history - G (at least n_min)
    k, g = t([0, 1, 0, 3]), t([0, 2, 3, 10])
    out = allocate_by_variance(k, g, budget=4 + 2 + 2 + 2, n_min=2, n_max=8, explore=0, min_history=4)
    assert out.tolist() == [4, 2, 2, 2]
    # all unknown, nobody has a priority: the rest is spread evenly from the bottom (the rollout_n outcome)
    zeros = torch.zeros(6, dtype=torch.long)
    assert allocate_by_variance(zeros, zeros, 96, 8, 24, explore=0).tolist() == [16] * 6


def test_all_mastered_split_evenly():
    k, g = t([10, 9, 20, 30]), t([10, 10, 20, 30])
    out = allocate_by_variance(k, g, budget=4 * 16, n_min=8, n_max=24, explore=16)
    assert out.tolist() == [16] * 4


def test_budget_extremes_and_single_prompt():
    k, g = t([0, 3, 5, 10]), t([0, 10, 10, 10])
    assert allocate_by_variance(k, g, 4 * 8, 8, 24, explore=24).tolist() == [8] * 4
    assert allocate_by_variance(k, g, 4 * 24, 8, 24, explore=0).tolist() == [24] * 4
    for budget in range(8, 25):
        assert allocate_by_variance(t([3]), t([10]), budget, 8, 24, explore=16).tolist() == [budget]
    assert allocate_by_variance(t([]), t([]), 0, 8, 24, explore=16).numel() == 0


def test_std_weighting_is_flatter_than_variance():
    k, g = t([5, 1]), t([10, 10])  # V = 25/90 and 9/90: ratio 2.78 (variance) vs 1.67 (std)
    budget, n_min = 2 * 8 + 1000, 8
    var = allocate_by_variance(k, g, budget, n_min, 10_000, explore=16, weight="variance")
    std = allocate_by_variance(k, g, budget, n_min, 10_000, explore=16, weight="std")
    assert var.tolist() == hamilton([8, 8], [25 / 90, 9 / 90], budget)
    assert std.tolist() == hamilton([8, 8], [math.sqrt(25 / 90), math.sqrt(9 / 90)], budget)
    assert (var[0] - n_min) / (var[1] - n_min) == pytest.approx(2.78, abs=0.02)
    assert (std[0] - n_min) / (std[1] - n_min) == pytest.approx(5 / 3, abs=0.02)
    assert std[1] > var[1]


def test_capped_allocation_redistributes():
    k, g = t([5, 4, 10, 10]), t([10, 10, 10, 10])
    out = allocate_by_variance(k, g, budget=4 * 18, n_min=8, n_max=24, explore=16)
    # shares of the 40 extra: 19.7, 18.9, 0.7, 0.7; the two high-variance prompts hit the cap (+16 each)
    # and the 6 units the cap frees go to the mastered pair, the only prompts left with room
    assert out.tolist() == [24, 24, 12, 12]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["rollout.n=7", "dynamo.n_min=8"], "dynamo.n_min"),
        (["rollout.n=25", "dynamo.n_max=24"], "dynamo.n_min"),
        (["dynamo.n_min=0"], "dynamo.n_min"),
        (["dynamo.n_min=16", "dynamo.n_max=8"], "dynamo.n_min"),
        (["dynamo.explore=-1"], "dynamo.explore"),
        (["dynamo.unknown_rule=other"], "dynamo.unknown_rule"),
    ],
)
def test_infeasible_config_is_refused_at_load(overrides, field):
    # a budget P·rollout.n outside [P·n_min, P·n_max] cannot be met: the dynamo section's checks refuse it
    with pytest.raises(ConfigError, match=field):
        load_config(None, ["method=dynamo", *overrides])


def test_bad_history_is_a_bug_not_a_config_error():
    with pytest.raises(ValueError):
        variance_priority(t([3]), t([2]))
    with pytest.raises(ValueError):
        variance_priority(t([1, 2]), t([3]))


def test_large_batch_runs_vectorised():
    gen = torch.Generator().manual_seed(0)
    g = torch.randint(0, 200, (4096,), generator=gen)
    k = (torch.rand(4096, generator=gen) * (g + 1)).long().clamp(max=g)
    out = allocate_by_variance(k, g, 4096 * 16, 8, 24, explore=16)
    assert int(out.sum()) == 4096 * 16 and int(out.min()) >= 8 and int(out.max()) <= 24


def test_allocation_metrics():
    counts, k, g = t([16, 24, 8, 8]), t([0, 5, 9, 2]), t([0, 10, 10, 10])
    m = allocation_metrics(counts, k, g)
    assert m == pytest.approx(
        {
            "alloc/n_min": 8.0,
            "alloc/n_mean": 14.0,
            "alloc/n_max": 24.0,
            "alloc/frac_budget_mastered": 8 / 56,
            "alloc/frac_unknown": 0.25,
        }
    )
