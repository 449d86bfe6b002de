"""Reinforce-Ada rounds, balanced keep and pool-baseline advantages (docs/methods.md#reinforce-ada)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from podsrl.algo.reinforce_ada import balanced_keep, exit_test, keep_quotas, pool_advantages
from podsrl.algo.selection import max_variance_subset, pack_groups


def t(xs, dtype=torch.long):
    return torch.tensor(xs, dtype=dtype)


def spec_pool():
    """§8(c): n = 4, M = 8, R = 4, balanced. Rows in generation order, round by round."""
    rounds = [
        {0: [1, 0, 1, 1, 0, 1, 1, 1], 1: [0] * 8, 2: [1] * 8},
        {1: [0, 0, 0, 1, 0, 0, 0, 0], 2: [1] * 8},
        {1: [0, 0, 0, 0, 0, 1, 0, 0], 2: [1] * 8},
        {2: [1] * 8},
    ]
    rewards, groups = [], []
    for r in rounds:
        for g, values in r.items():
            rewards += values
            groups += [g] * len(values)
    return t(rewards, torch.float32), t(groups), rounds


def test_exit_rules():
    pos, neg = t([2, 1, 0, 4, 2]), t([2, 3, 8, 0, 1])
    assert exit_test(pos, neg, 4, "balanced").tolist() == [True, False, False, False, False]
    assert exit_test(pos, neg, 4, "positive_focused").tolist() == [True, True, False, True, True]
    # odd n: floor(n/2) positives, the rest negatives
    assert exit_test(t([1, 2]), t([2, 1]), 3, "balanced").tolist() == [True, False]
    with pytest.raises(ValueError, match="exit_rule"):
        exit_test(pos, neg, 4, "greedy")


def test_spec_example_rounds_keep_and_advantages():
    rewards, groups, rounds = spec_pool()
    n, tau = 4, 0.7
    # replay the exit tests round by round
    pos, neg = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    active = torch.ones(3, dtype=torch.bool)
    exited_in = [None] * 3
    generated = 0
    for number, r in enumerate(rounds, start=1):
        assert sorted(r) == active.nonzero().flatten().tolist(), "each round samples exactly the active prompts"
        for g, values in r.items():
            generated += len(values)
            pos[g] += sum(v > tau for v in values)
            neg[g] += sum(v <= tau for v in values)
        done = exit_test(pos, neg, n, "balanced") & active
        for g in done.nonzero().flatten().tolist():
            exited_in[g] = number
        active &= ~done
    assert exited_in == [1, 3, None]
    assert (pos.tolist(), neg.tolist()) == ([6, 2, 32], [2, 22, 0])
    assert generated == 24 + 16 + 16 + 8 == 64
    resolved = t([True, True, False], torch.bool)
    kept = balanced_keep(rewards > tau, groups, 3, resolved, n, "balanced")
    assert kept.numel() == 12
    # P1 keeps its first two positives (rows 0, 2) and first two negatives (rows 1, 4): [1, 1, 0, 0]
    assert kept[groups[kept] == 0].tolist() == [0, 1, 2, 4]
    assert sorted(rewards[kept][groups[kept] == 1].tolist()) == [0, 0, 1, 1]
    assert rewards[kept][groups[kept] == 2].tolist() == [1, 1, 1, 1]
    adv = pool_advantages(rewards[kept], groups[kept], rewards, groups, 3)
    by_group = {g: sorted(adv[groups[kept] == g].tolist()) for g in range(3)}
    assert by_group[0] == pytest.approx([-0.75, -0.75, 0.25, 0.25])
    assert by_group[1] == pytest.approx([-1 / 12, -1 / 12, 11 / 12, 11 / 12])
    assert by_group[2] == [0.0] * 4


def test_quotas_top_up_and_unresolved():
    # balanced, unresolved all-fail pool keeps n failures; a pool smaller than n keeps all of it
    kp, kn = keep_quotas(t([0, 1, 5, 3]), t([32, 1, 0, 9]), t([False, False, False, True], torch.bool), 4,
                         "balanced")
    assert kp.tolist() == [0, 1, 4, 2] and kn.tolist() == [4, 1, 0, 2]
    # positive_focused unresolved: ceil(pos/pool * n) clamped to [1, take-1]
    kp, kn = keep_quotas(t([0, 1, 3]), t([16, 2, 1]), t([False, False, False], torch.bool), 4, "positive_focused")
    assert kp.tolist() == [0, 1, 3] and kn.tolist() == [4, 2, 1]  # middle: share 2, only 1 positive
    # positive_focused exited prompts use the balanced rule
    kp, kn = keep_quotas(t([1, 7]), t([7, 1]), t([True, True], torch.bool), 4, "positive_focused")
    assert kp.tolist() == [1, 3] and kn.tolist() == [3, 1]


def test_std_variant_and_single_rollout_pool():
    rewards, groups = t([1.0, 0.0, 0.0, 0.0, 1.0], torch.float32), t([0, 0, 0, 0, 1])
    adv = pool_advantages(rewards, groups, rewards, groups, 2, std=True)
    std = torch.tensor([1.0, 0, 0, 0]).std().item()
    assert adv[:4].tolist() == pytest.approx([0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3, rel=1e-6)
    assert adv[4].item() == 1.0  # a pool of one: mean 0, std 1 (the reference), so A = r
    assert pool_advantages(rewards, groups, rewards, groups, 2)[4].item() == 1.0
    # a constant pool gets exactly zero with or without std
    const = t([1.0, 1.0, 1.0], torch.float32)
    assert pool_advantages(const, t([0, 0, 0]), const, t([0, 0, 0]), 1, std=True).tolist() == [0.0] * 3


@settings(max_examples=200, deadline=None)
@given(data=st.data(), groups=st.integers(1, 5), n=st.integers(1, 8))
def test_balanced_keep_matches_max_variance_on_binary_rewards(data, groups, n):
    """§8(a): on binary rewards the balanced keep gives PODS max-variance's counts with m = n on the pool."""
    sizes = data.draw(st.lists(st.integers(1, 20), min_size=groups, max_size=groups))
    bits = [data.draw(st.lists(st.booleans(), min_size=s, max_size=s)) for s in sizes]
    rewards = torch.tensor([float(b) for bs in bits for b in bs])
    group_index = torch.tensor([g for g, s in enumerate(sizes) for _ in range(s)])
    resolved = torch.tensor(data.draw(st.lists(st.booleans(), min_size=groups, max_size=groups)))
    kept = balanced_keep(rewards > 0.5, group_index, groups, resolved, n, "balanced")
    padded, mask, _ = pack_groups(rewards, group_index, groups, fill=0.0)
    pods = max_variance_subset(padded, mask, n)
    kept_pos = torch.bincount(group_index[kept], weights=rewards[kept], minlength=groups)
    kept_all = torch.bincount(group_index[kept], minlength=groups)
    assert kept_all.tolist() == pods.sum(1).tolist()
    # same number of positives, or the mirror image (both have the same variance when n is odd)
    pods_pos = (padded * pods).sum(1)
    for g in range(groups):
        assert kept_pos[g].item() in (pods_pos[g].item(), kept_all[g].item() - pods_pos[g].item())
    # kept rows of each sign are the earliest of that sign
    for g in range(groups):
        for sign in (True, False):
            rows = ((group_index == g) & ((rewards > 0.5) == sign)).nonzero().flatten().tolist()
            chosen = [r for r in kept.tolist() if r in rows]
            assert chosen == rows[: len(chosen)]


# ------------------------------------------------------------------------------------------ the method


def ada_config(**overrides):
    from podsrl.methods.reinforce_ada import ReinforceAda
    from tests.method_helpers import method_config

    return method_config(ReinforceAda, "rollout.n=4", *[f"{k}={v}" for k, v in overrides.items()])


def test_method_spec_example_end_to_end():
    from podsrl.methods.reinforce_ada import ReinforceAda
    from tests.method_helpers import ScriptedContext, problems

    _, _, rounds = spec_pool()
    script = {f"p{g}": [] for g in range(3)}
    for r in rounds:
        for g, values in r.items():
            script[f"p{g}"] += values
    ctx = ScriptedContext(ada_config(), lambda uid, k: script[uid][k] > 0.5)
    method = ReinforceAda(ctx.cfg)
    pool, metrics = method.collect(problems(3), ctx)
    assert [c[0] for c in ctx.calls] == [["p0", "p1", "p2"], ["p1", "p2"], ["p1", "p2"], ["p2"]]
    assert pool.num_rollouts == 64
    assert metrics["sampling/total_samples"] == 64 and metrics["sampling/rounds"] == 4
    assert metrics["sampling/prompts_active_only_1st_round"] == 1 and metrics["sampling/prompts_unfinished"] == 1
    assert metrics["critic/real_reward"] == pytest.approx((6 + 0 + 8) / 24)
    kept, more = method.select(pool, ctx)
    assert kept.num_rollouts == 12 and more["sampling/kept_samples"] == 12
    by_group = {g: sorted(kept.advantages[kept.group_index == g].tolist()) for g in range(3)}
    assert by_group[0] == pytest.approx([-0.75, -0.75, 0.25, 0.25])
    assert by_group[1] == pytest.approx([-1 / 12, -1 / 12, 11 / 12, 11 / 12])
    assert by_group[2] == [0.0] * 4


def test_method_positive_focused_and_round_cap():
    from podsrl.methods.reinforce_ada import ReinforceAda
    from tests.method_helpers import ScriptedContext, problems

    # one success in 6: positive_focused exits after round 1 (M = 8); balanced needs a second positive
    cfg = ada_config(**{"reinforce_ada.exit_rule": "positive_focused", "reinforce_ada.max_rounds": 2})
    ctx = ScriptedContext(cfg, lambda uid, k: k % 6 == 5)
    pool, metrics = ReinforceAda(cfg).collect(problems(2), ctx)
    assert pool.num_rollouts == 16 and metrics["sampling/rounds"] == 1
    kept, _ = ReinforceAda(cfg).select(pool, ctx)
    assert kept.correct.sum().item() == 2 and kept.num_rollouts == 8  # 1 positive + 3 negatives each
    # never solved: the round cap stops it, n failures kept with advantage 0
    cfg = ada_config(**{"reinforce_ada.max_rounds": 3})
    ctx = ScriptedContext(cfg, lambda uid, k: False)
    pool, metrics = ReinforceAda(cfg).collect(problems(1), ctx)
    assert pool.num_rollouts == 24 and metrics["sampling/prompts_unfinished"] == 1
    kept, _ = ReinforceAda(cfg).select(pool, ctx)
    assert kept.num_rollouts == 4 and kept.advantages.abs().sum().item() == 0.0


def test_method_config_errors():
    from podsrl.errors import ConfigError

    with pytest.raises(ConfigError, match="reinforce_ada.round_repeat"):
        ada_config(**{"reinforce_ada.round_repeat": 0})
    with pytest.raises(ConfigError, match="reinforce_ada.exit_rule"):
        ada_config(**{"reinforce_ada.exit_rule": "greedy"})


def test_trains_end_to_end(tmp_path, warmup_cache):
    from tests.method_helpers import train_preset

    steps = train_preset("reinforce_ada", tmp_path / "run", warmup_cache, **{"reinforce_ada.round_repeat": 4,
                                                                              "reinforce_ada.max_rounds": 3})
    assert len(steps) == 6
    for r in steps:
        # every round is counted as generated; 4 prompts keep n = 4 each
        assert r["rollouts/generated"] == r["sampling/total_samples"]
        assert 16 <= r["rollouts/generated"] <= 48 and r["rollouts/generated"] % 4 == 0
        assert r["rollouts/trained"] == r["sampling/kept_samples"] == 16
        assert r["sampling/prompts_active_only_1st_round"] + r["sampling/prompts_unfinished"] <= 4


# ------------------------------------------------------------------------------ rules a mutation would change


def _pool(rewards: list[float], n: int, **overrides):
    from podsrl.methods import offline_context
    from podsrl.methods.reinforce_ada import ReinforceAda
    from tests.method_helpers import problems, scored_batch

    cfg = ada_config(**{"rollout.n": n, **overrides})
    batch = scored_batch(problems(1), [0], [len(rewards)], [r > 0.5 for r in rewards])
    batch.rewards = torch.tensor(rewards)
    return ReinforceAda(cfg).select(batch, offline_context(cfg, torch.Generator().manual_seed(0)))


def test_a_reward_equal_to_the_threshold_is_negative():
    """τ = 0.7: positive iff reward > τ. Pool [1, .7, .7, 0, 0, 1]: 2 positives, so the kept 4 are the two 1s and
    the first two negatives (the 0.7s); counting 0.7 as positive would keep [1, .7] and the two 0s."""
    kept, _ = _pool([1.0, 0.7, 0.7, 0.0, 0.0, 1.0], 4)
    assert sorted(kept.rewards.tolist()) == pytest.approx([0.7, 0.7, 1.0, 1.0])


def test_a_resolved_positive_focused_pool_keeps_the_balanced_split():
    """positive_focused, n = 4, 5 positives of 8: resolved, so 2 positives + 2 negatives (an unresolved pool would
    keep ceil(5/8 * 4) = 3 positives and 1 negative)."""
    kept, _ = _pool([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0], 4, **{"reinforce_ada.exit_rule": "positive_focused"})
    assert sorted(kept.rewards.tolist()) == [0.0, 0.0, 1.0, 1.0]


def test_rollouts_at_the_threshold_do_not_end_sampling():
    """Every reward is 0.7 (= τ) or 0: no rollout is positive, so the prompt never passes the exit test and all
    max_rounds rounds run; counting 0.7 as positive would stop after round 1."""
    from podsrl.methods.reinforce_ada import ReinforceAda
    from tests.method_helpers import ScriptedContext, problems

    ctx = ScriptedContext(ada_config(), lambda uid, k: k % 2 == 0)
    scripted = ctx.generate

    def generate(batch_problems, indices, counts):
        batch = scripted(batch_problems, indices, counts)
        batch.rewards = batch.correct.float() * 0.7
        return batch

    ctx.generate = generate
    _, metrics = ReinforceAda(ctx.cfg).collect(problems(1), ctx)
    assert metrics["sampling/rounds"] == 4 and metrics["sampling/prompts_unfinished"] == 1
