"""AERO pieces: batched rescue rounds, selective rejection counts, dead-zone posterior and GRPO advantages."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from podsrl.algo import advantages, selection
from podsrl.algo.advantages import grpo_advantages
from podsrl.batch import Problem, RolloutBatch
from podsrl.config import load_config
from podsrl.errors import ConfigError
from podsrl.methods import offline_context
from podsrl.methods.aero import AERO, collect_aero_rollouts, rescued_groups
from podsrl.prompt_stats import PromptStats

# the kernels take every setting; a test's unnamed ones are the config's defaults (the aero and algo sections)
_DEFAULTS = load_config(None, ["method=aero"])
_SELECT = {"k": _DEFAULTS.aero.k, "symmetric": _DEFAULTS.aero.symmetric, "keep_dead": _DEFAULTS.aero.keep_dead}
_ADVANTAGE = {"mode": _DEFAULTS.aero.dead_zone_advantage, "epsilon": _DEFAULTS.algo.advantage_epsilon,
              "scale": _DEFAULTS.algo.scale}


def aero_select(batch, posterior_mean, **settings):
    return selection.aero_select(batch, posterior_mean, **{**_SELECT, **settings})


def aero_advantages(*rows_and_posterior, **settings):
    return advantages.aero_advantages(*rows_and_posterior, **{**_ADVANTAGE, **settings})


def posterior_after_update(stats: PromptStats, batch: RolloutBatch) -> torch.Tensor:
    """What the loop does before AERO's select: record the step's outcomes, then read the posterior means."""
    uids = [p.uid for p in batch.problems]
    stats.record(uids, batch.group_index, batch.correct)
    return stats.posterior_mean(uids)


def make_batch(problems: list[Problem], group_index: list[int], correct: list[bool], rewards=None, width=3):
    r = len(group_index)
    lengths = torch.tensor([1 + (i % width) for i in range(r)])
    comp_mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    correct_t = torch.tensor(correct, dtype=torch.bool)
    return RolloutBatch(
        problems=problems,
        group_index=torch.tensor(group_index, dtype=torch.long),
        prompt_ids=torch.full((r, 2), 5, dtype=torch.long),
        prompt_mask=torch.ones(r, 2, dtype=torch.long),
        completion_ids=torch.where(comp_mask.bool(), 7, 0).long(),
        completion_mask=comp_mask,
        truncated=torch.zeros(r, dtype=torch.bool),
        completions=[f"c{i}" for i in range(r)],
        rewards=correct_t.float() if rewards is None else torch.tensor(rewards, dtype=torch.float32),
        correct=correct_t,
    )


def problems_of(p: int) -> list[Problem]:
    return [Problem(uid=f"q{i}", prompt=f"prompt {i}", answer="1") for i in range(p)]


class ScriptedEngine:
    """Fake generate_and_score: prompt i's j-th rollout ever drawn is outcomes[i][j]; records every call."""

    def __init__(self, outcomes: list[list[bool]]):
        self.outcomes = outcomes
        self.problems = problems_of(len(outcomes))
        self.drawn = [0] * len(outcomes)
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, indices: list[int], counts: list[int]) -> RolloutBatch:
        self.calls.append((list(indices), list(counts)))
        gi, corr = [], []
        for i, c in zip(indices, counts):
            for _ in range(c):
                gi.append(i)
                corr.append(self.outcomes[i][self.drawn[i]])
                self.drawn[i] += 1
        # a different completion width per round exercises the re-padding in concat_batches
        return make_batch(self.problems, gi, corr, width=1 + len(self.calls))


F, T = False, True


def test_rescue_rounds_are_batched_and_stop_at_first_success_or_cap():
    outcomes = [
        [F, T, F, F] + [F] * 10,  # success while exploring: never rescued
        [F] * 4 + [F, T] + [F] * 10,  # rescued in round 2
        [F] * 6 + [T, F] + [F] * 4,  # rescued in round 3
        [F] * 14,  # never succeeds: capped at n_max = 9 (last round asks for only 1)
    ]
    engine = ScriptedEngine(outcomes)
    batch, m = collect_aero_rollouts(4, engine, n_explore=4, n_extra=2, n_max=9, pad_token_id=0)
    assert engine.calls == [
        ([0, 1, 2, 3], [4, 4, 4, 4]),
        ([1, 2, 3], [2, 2, 2]),
        ([2, 3], [2, 2]),
        ([3], [1]),
    ]
    assert batch.problems is engine.problems
    assert batch.group_sizes().tolist() == [4, 6, 8, 9]
    assert torch.bincount(batch.group_index[batch.correct], minlength=4).tolist() == [1, 1, 1, 0]
    # rows keep their own outcomes through the concatenation
    for i in range(4):
        assert batch.correct[batch.group_index == i].tolist() == outcomes[i][: engine.drawn[i]]
    assert batch.completion_ids.shape[0] == batch.completion_mask.shape[0] == len(batch.completions) == 27
    assert m["aero/rounds"] == 4
    assert m["aero/rollouts_generated"] == 27 and m["aero/rollouts_rescue"] == 11
    assert m["aero/frac_needed_rescue"] == pytest.approx(3 / 4)
    assert m["aero/frac_rescued"] == pytest.approx(2 / 4)
    assert m["aero/frac_rescue_failed"] == pytest.approx(1 / 4)


def test_rescue_count_is_capped_by_n_max():
    engine = ScriptedEngine([[F] * 20, [F] * 20])
    batch, m = collect_aero_rollouts(2, engine, n_explore=4, n_extra=3, n_max=9, pad_token_id=0)
    assert engine.calls == [([0, 1], [4, 4]), ([0, 1], [3, 3]), ([0, 1], [2, 2])]
    assert batch.group_sizes().tolist() == [9, 9] and m["aero/frac_rescue_failed"] == 1.0


def test_no_rescue_when_every_prompt_succeeds_or_cap_equals_explore():
    engine = ScriptedEngine([[T] * 8, [F, T] * 4])
    batch, m = collect_aero_rollouts(2, engine, n_explore=8, n_extra=2, n_max=16, pad_token_id=0)
    assert len(engine.calls) == 1 and m["aero/rounds"] == 1 and m["aero/frac_rescued"] == 0
    engine = ScriptedEngine([[F] * 8])
    batch, m = collect_aero_rollouts(1, engine, n_explore=8, n_extra=2, n_max=8, pad_token_id=0)
    assert len(engine.calls) == 1 and m["aero/frac_rescue_failed"] == 1.0 and batch.num_rollouts == 8


def test_round_returning_wrong_counts_is_an_error():
    engine = ScriptedEngine([[F] * 20])

    def short(indices, counts):
        return engine(indices, [c - 1 for c in counts])

    with pytest.raises(ValueError, match="asked for 8"):
        collect_aero_rollouts(1, short, n_explore=8, n_extra=2, n_max=16, pad_token_id=0)
    with pytest.raises(ValueError, match="n_max"):
        collect_aero_rollouts(1, engine, n_explore=8, n_extra=2, n_max=4, pad_token_id=0)


# --------------------------------------------------------------------------------------------- selection


def grouped(sizes_and_successes: list[tuple[int, int]], shuffle_seed: int | None = 0):
    """A batch with group i holding n_i rows of which c_i are correct, rows interleaved in a random order."""
    gi, corr = [], []
    for i, (n, c) in enumerate(sizes_and_successes):
        gi += [i] * n
        corr += [True] * c + [False] * (n - c)
    if shuffle_seed is not None:
        perm = torch.randperm(len(gi), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
        gi, corr = [gi[j] for j in perm], [corr[j] for j in perm]
    return make_batch(problems_of(len(sizes_and_successes)), gi, corr)


def kept_counts(batch, kept):
    g, c = batch.group_index[kept], batch.correct[kept]
    p = batch.num_groups
    return torch.bincount(g[c], minlength=p).tolist(), torch.bincount(g[~c], minlength=p).tolist()


def expected_counts(n, c, k, symmetric, keep_dead):
    """Brute-force reference, one group at a time."""
    f = n - c
    if n == 0:
        return 0, 0
    if c == 0 or c == n:
        return min(c, keep_dead), min(f, keep_dead)
    if 2 * c < n:
        return c, min(max(math.floor(k * c + 0.5), 1), f)
    if symmetric and 2 * f < n:
        return min(max(math.floor(k * f + 0.5), 1), c), f
    return c, f


def test_selective_rejection_counts_by_hand():
    groups = [(8, 2), (8, 6), (8, 4), (16, 0), (3, 3), (8, 1)]
    batch = grouped(groups)
    u = torch.full((6,), 0.3, dtype=torch.float64)
    kept, dead, m = aero_select(batch, u, k=1.0, generator=torch.Generator().manual_seed(1))
    assert kept_counts(batch, kept) == ([2, 6, 4, 0, 3, 1], [2, 2, 4, 4, 0, 1])
    assert dead.tolist() == [F, F, F, T, T, F]
    assert torch.equal(kept, torch.sort(kept).values) and kept.unique().numel() == kept.numel()
    assert m["aero/frac_dead_zone"] == pytest.approx(2 / 6)
    assert m["aero/frac_rejected_groups"] == pytest.approx(2 / 6)  # groups 0 and 5 lose failures

    kept, _, _ = aero_select(batch, u, k=2.0, generator=torch.Generator().manual_seed(1))
    assert kept_counts(batch, kept) == ([2, 6, 4, 0, 3, 1], [4, 2, 4, 4, 0, 2])
    kept, _, m = aero_select(batch, u, k=1.0, symmetric=True, generator=torch.Generator().manual_seed(1))
    assert kept_counts(batch, kept) == ([2, 2, 4, 0, 3, 1], [2, 2, 4, 4, 0, 1])
    assert m["aero/frac_rejected_groups"] == pytest.approx(3 / 6)
    kept, _, _ = aero_select(batch, u, k=2.0, symmetric=True, keep_dead=2, generator=torch.Generator().manual_seed(1))
    assert kept_counts(batch, kept) == ([2, 4, 4, 0, 2, 1], [4, 2, 4, 2, 0, 2])
    kept, _, _ = aero_select(batch, u, k=1.5, generator=torch.Generator().manual_seed(1))  # 1.5 -> 2, 3 -> 3
    assert kept_counts(batch, kept)[1] == [3, 2, 4, 4, 0, 2]
    # half-up rounding (4.5 -> 5), k < 1 at u = 0.5 keeps everything, and a small k still keeps one failure
    batch = grouped([(10, 3), (4, 2), (6, 1)])
    kept, _, _ = aero_select(batch, torch.full((3,), 0.5), k=1.5, generator=torch.Generator().manual_seed(2))
    assert kept_counts(batch, kept) == ([3, 2, 1], [5, 2, 2])
    kept, _, _ = aero_select(batch, torch.full((3,), 0.5), k=0.25, generator=torch.Generator().manual_seed(2))
    assert kept_counts(batch, kept) == ([3, 2, 1], [1, 2, 1])


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=8),
    k=st.sampled_from([0.3, 0.5, 1.0, 1.5, 2.0, 3.0]),
    symmetric=st.booleans(),
    keep_dead=st.integers(0, 5),
    seed=st.integers(0, 1000),
)
def test_selection_matches_per_group_reference(groups, k, symmetric, keep_dead, seed):
    groups = [(n, min(c, n)) for n, c in groups]
    batch = grouped(groups, shuffle_seed=seed)
    u = torch.full((len(groups),), 0.5, dtype=torch.float64)
    kept, dead, _ = aero_select(
        batch, u, k=k, symmetric=symmetric, keep_dead=keep_dead, generator=torch.Generator().manual_seed(seed)
    )
    succ, fail = kept_counts(batch, kept)
    for i, (n, c) in enumerate(groups):
        assert (succ[i], fail[i]) == expected_counts(n, c, k, symmetric, keep_dead)
        assert bool(dead[i]) == (n > 0 and (c == 0 or c == n))
    again, _, _ = aero_select(
        batch, u, k=k, symmetric=symmetric, keep_dead=keep_dead, generator=torch.Generator().manual_seed(seed)
    )
    assert torch.equal(kept, again)


def test_rejected_failures_are_chosen_uniformly():
    batch = grouped([(8, 1)], shuffle_seed=None)  # row 0 correct, rows 1..7 failures; one failure kept
    u = torch.tensor([0.5], dtype=torch.float64)
    picks = torch.zeros(8)
    gen = torch.Generator().manual_seed(0)
    trials = 1400
    for _ in range(trials):
        kept, _, _ = aero_select(batch, u, generator=gen)
        picks[kept] += 1
    assert picks[0] == trials
    assert picks[1:].sum() == trials
    assert ((picks[1:] - trials / 7).abs() < 60).all(), picks  # 200 expected each, sd ~13


def aero_method(*overrides: str) -> AERO:
    return AERO(load_config(None, ["method=aero", *overrides]))


def test_zero_advantage_metrics_before_and_after():
    # group 0: 1/4 correct -> 1 success + 1 failure kept, non-zero; group 1: dead all-fail (4 of 6 kept);
    # group 2: single rollout (size-1 group, zero advantage either way)
    batch = grouped([(4, 1), (6, 0), (1, 1)])
    stats = PromptStats()  # posterior means after the loop records this step: 3/7, 2/10, 2/4
    stats.update([p.uid for p in batch.problems], [1, 1, 0], [1, 2, 1])
    stats.record([p.uid for p in batch.problems], batch.group_index, batch.correct)
    ctx = offline_context(aero_method().cfg, torch.Generator().manual_seed(0), stats)
    kept, m = aero_method().select(batch, ctx)
    assert kept.num_rollouts == 2 + 4 + 1
    assert m["aero/frac_zero_adv_before"] == pytest.approx(5 / 7)
    # baseline mode: group 2 (dead, all-success, ũ=0.5) gets (1-0.5)/0.5 = 1, so nothing stays zero
    assert m["aero/frac_zero_adv_after"] == 0.0
    ctx = offline_context(aero_method().cfg, torch.Generator().manual_seed(0), stats)
    _, m = aero_method("aero.dead_zone_advantage=constant").select(batch, ctx)
    assert m["aero/frac_zero_adv_after"] == pytest.approx(1 / 7)  # 2·0.5 − 1 = 0 for group 2


def test_rescued_groups_are_rejected_unless_reject_rescued_is_off():
    # prompt 0 fails its 4 explore rollouts and succeeds in the 2nd rescue round: 1 success in 8 (u = 1/8)
    engine = ScriptedEngine([[F] * 6 + [T, F], [T, F, F, F]])
    batch, _ = collect_aero_rollouts(2, engine, n_explore=4, n_extra=2, n_max=8, pad_token_id=0)
    assert rescued_groups(batch, 4).tolist() == [T, F]
    stats = PromptStats()
    stats.record([p.uid for p in batch.problems], batch.group_index, batch.correct)
    sizes = {}
    for reject in (True, False):
        method = aero_method("aero.n_explore=4", "aero.n_max=8", f"aero.reject_rescued={str(reject).lower()}")
        kept, _ = method.select(batch, offline_context(method.cfg, torch.Generator().manual_seed(0), stats))
        sizes[reject] = kept.group_sizes().tolist()
    assert sizes[True] == [2, 2]  # the rescued group is trimmed to 1 success + 1 failure like any u < 0.5 group
    assert sizes[False] == [8, 2]  # kept whole; the never-rescued group is still trimmed


def test_aero_refuses_zero_variance_filtering():
    with pytest.raises(ConfigError, match="filter.zero_variance"):
        load_config(None, ["method=aero", "filter.zero_variance=true"])


# --------------------------------------------------------------------------------------------- advantages


def test_grpo_advantages_by_hand_with_unequal_groups():
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 0.7, 0.2, 0.2]
    gi = [0, 0, 1, 0, 1, 2, 3, 3]  # sizes 3, 2, 1, 2 (rows interleaved)
    eps = 1e-4
    adv = grpo_advantages(torch.tensor(rewards), torch.tensor(gi), 5, "group", eps)
    expected = []
    for r, g in zip(rewards, gi):
        members = [x for x, h in zip(rewards, gi) if h == g]
        if len(members) < 2 or len(set(members)) == 1:
            expected.append(0.0)
        else:
            expected.append((r - statistics.fmean(members)) / (statistics.stdev(members) + eps))
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert adv.dtype == torch.float32 and adv[5] == 0 and adv[6] == 0 and adv[7] == 0
    # a constant-reward group is exactly 0 even where the float mean does not reproduce the value
    flat = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7], dtype=torch.float64)
    adv = grpo_advantages(flat, torch.tensor([0, 0, 0] + [1] * 7), 2, "group", eps)
    assert (adv == 0).all()


def test_dead_zone_baseline_and_constant_by_hand():
    stats = PromptStats()
    stats.update(["q0", "q1"], [0, 9], [10, 10])  # earlier steps
    problems = problems_of(3)
    # this step: q0 all-fail (4), q1 all-success (4), q2 mixed 1 of 4
    batch = make_batch(problems, [0] * 4 + [1] * 4 + [2] * 4, [F] * 4 + [T] * 4 + [T, F, F, F])
    u = posterior_after_update(stats, batch)
    assert u.tolist() == pytest.approx([1 / 16, 14 / 16, 2 / 6])  # Beta(1+S, 1+F) means, this step included
    dead = torch.tensor([T, T, F])
    adv = aero_advantages(batch.rewards, batch.correct, batch.group_index, 3, dead, u)
    a0 = (0 - 1 / 16) / math.sqrt(1 / 16 * 15 / 16)
    a1 = (1 - 14 / 16) / math.sqrt(14 / 16 * 2 / 16)
    sd = statistics.stdev([1, 0, 0, 0])
    a2 = [(1 - 0.25) / (sd + 1e-4)] + [(0 - 0.25) / (sd + 1e-4)] * 3
    assert adv.tolist() == pytest.approx([a0] * 4 + [a1] * 4 + a2, abs=1e-6)
    assert (adv[:8] != 0).all()

    const = aero_advantages(batch.rewards, batch.correct, batch.group_index, 3, dead, u, mode="constant")
    assert const.tolist() == pytest.approx([2 / 16 - 1] * 4 + [28 / 16 - 1] * 4 + a2, abs=1e-6)
    with pytest.raises(ValueError, match="mode"):
        aero_advantages(batch.rewards, batch.correct, batch.group_index, 3, dead, u, mode="other")


def test_dead_zone_uses_correctness_not_format_bonus_and_is_finite_at_extremes():
    problems = problems_of(1)
    batch = make_batch(problems, [0, 0], [F, F], rewards=[0.2, 0.0])  # format bonus on a wrong answer
    u = torch.tensor([0.05], dtype=torch.float64)
    adv = aero_advantages(batch.rewards, batch.correct, batch.group_index, 1, torch.tensor([T]), u)
    assert (adv < 0).all() and adv[0] == adv[1]
    for extreme in (0.0, 1.0):
        adv = aero_advantages(
            batch.rewards, batch.correct, batch.group_index, 1, torch.tensor([T]), torch.tensor([extreme])
        )
        assert torch.isfinite(adv).all()


def test_statistics_survive_prompt_stats_round_trip():
    engine = ScriptedEngine([[F] * 16, [T, F] * 8, [T] * 16])
    batch, _ = collect_aero_rollouts(3, engine, n_explore=8, n_extra=2, n_max=16, pad_token_id=0)
    stats = PromptStats()
    stats.update(["q0", "q2", "other"], [1, 3, 2], [5, 3, 9])
    u = posterior_after_update(stats, batch)
    restored = PromptStats()
    restored.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    uids = [p.uid for p in batch.problems]
    assert torch.equal(restored.posterior_mean(uids), u)
    assert restored.counts(uids)[1].tolist() == [5 + 16, 8, 3 + 8]
    kept, dead, _ = aero_select(batch, u, generator=torch.Generator().manual_seed(3))
    train = batch.select_rows(kept)
    a = aero_advantages(train.rewards, train.correct, train.group_index, 3, dead, u)
    b = aero_advantages(train.rewards, train.correct, train.group_index, 3, dead, restored.posterior_mean(uids))
    assert torch.equal(a, b) and (a != 0).all()
