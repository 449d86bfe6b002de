"""GRESO pre-rollout skipping (docs/methods.md#greso): skip probabilities, decisions, adaptation, refill estimate."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from podsrl.algo.greso import (
    KEPT,
    SKIPPED_EASY,
    SKIPPED_HARD,
    adapt_exploration,
    refill_estimate,
    skip_decisions,
    skip_probabilities,
)
from podsrl.methods.greso import GresoConfig

FLOOR = GresoConfig().min_keep  # the section's defaults, which the method passes
STEP = dict(step=GresoConfig().p_step, lowest=GresoConfig().p_min, highest=GresoConfig().p_max)


def t(xs, dtype=torch.long):
    return torch.tensor(xs, dtype=dtype)


# §6(c): A no history, B [mixed, all-correct, all-correct], C [all-wrong x3], D [all-correct, mixed],
# E [all-correct x8] -> streaks (easy, hard)
EASY, HARD = t([0, 2, 0, 0, 8]), t([0, 0, 3, 0, 0])


def test_spec_example_probabilities():
    easy_p, hard_p = skip_probabilities(EASY, HARD, 0.5, 0.5, FLOOR)
    skip = torch.where(EASY > 0, easy_p, hard_p)
    assert skip.tolist() == pytest.approx([0.0, 0.75, 0.875, 0.0, 0.99])


def test_spec_example_decisions():
    # u_B = 0.8 keeps B (0.8 >= 0.75); u_C = 0.5 skips C (0.5 < 0.875); a zero streak is never skipped
    uniforms = torch.tensor([[0.0, 0.0], [0.8, 0.0], [0.9, 0.5], [0.0, 0.0], [0.985, 0.0]])
    codes = skip_decisions(EASY, HARD, 0.5, 0.5, uniforms, FLOOR)
    assert codes.tolist() == [KEPT, KEPT, SKIPPED_HARD, KEPT, SKIPPED_EASY]
    # the easy test comes first: a prompt skipped as easy is not counted as hard
    both = skip_decisions(t([1]), t([1]), 0.5, 0.5, torch.tensor([[0.1, 0.1]]), FLOOR)
    assert both.tolist() == [SKIPPED_EASY]


def test_spec_example_adaptation():
    # epoch 1, 100 groups: 20 all-wrong (>= 2T/3 = 0.1667) -> p_hard down; 5 all-correct (< T/3) -> p_easy up
    target = 0.25
    assert adapt_exploration(0.5, 20 / 100, 2 * target / 3, **STEP) == 0.49
    assert adapt_exploration(0.5, 5 / 100, target / 3, **STEP) == 0.51
    # clamped to [0.05, 0.95]
    assert adapt_exploration(0.05, 1.0, 0.1, **STEP) == 0.05
    assert adapt_exploration(0.95, 0.0, 0.1, **STEP) == 0.95
    p = 0.5
    for _ in range(100):
        p = adapt_exploration(p, 1.0, 0.1, **STEP)
    assert p == 0.05


def test_refill_estimate():
    # 30 groups missing at zvr 0.5: 30 / 0.5 * 1.25 = 75, within [8, 48] -> 48
    assert refill_estimate(30, 0.5, 1.25, lowest=8, highest=48) == 48
    assert refill_estimate(10, 0.5, 1.25, lowest=8, highest=48) == 25
    assert refill_estimate(2, 0.0, 1.25, lowest=8, highest=48) == 8
    # zvr = 1 divides by zero in the reference: the largest draw
    assert refill_estimate(5, 1.0, 1.25, lowest=8, highest=48) == 48
    assert refill_estimate(0, 0.3, 1.25, lowest=8, highest=48) == 0


@settings(max_examples=100, deadline=None)
@given(easy=st.lists(st.integers(0, 10), min_size=1, max_size=30), seed=st.integers(0, 2**31),
       p_easy=st.floats(0.05, 0.95), p_hard=st.floats(0.05, 0.95))
def test_decisions_deterministic_and_consistent(easy, seed, p_easy, p_hard):
    easy_t = torch.tensor(easy)
    hard_t = torch.tensor([0 if e else (i % 4) for i, e in enumerate(easy)])  # streaks exclude each other
    draws = torch.rand((len(easy), 2), generator=torch.Generator().manual_seed(seed))
    a = skip_decisions(easy_t, hard_t, p_easy, p_hard, draws, FLOOR)
    b = skip_decisions(easy_t, hard_t, p_easy, p_hard, draws.clone(), FLOOR)
    assert torch.equal(a, b)
    never = (easy_t == 0) & (hard_t == 0)
    assert (a[never] == KEPT).all()
    assert ((a != SKIPPED_EASY) | (easy_t > 0)).all() and ((a != SKIPPED_HARD) | (hard_t > 0)).all()
    easy_p, hard_p = skip_probabilities(easy_t, hard_t, p_easy, p_hard, FLOOR)
    assert float(easy_p.max()) <= 0.99 + 1e-12 and float(hard_p.max()) <= 0.99 + 1e-12


# ------------------------------------------------------------------------------------------ the method


def greso_config(**overrides):
    from podsrl.methods.greso import Greso
    from tests.method_helpers import method_config

    return method_config(Greso, "rollout.n=8", "rollout.prompts_per_step=4",
                         *[f"{k}={v}" for k, v in overrides.items()])


def visit(stats, uid, bits):
    stats.record([uid], torch.zeros(len(bits), dtype=torch.long), torch.tensor(bits))


def test_spec_example_streaks_from_prompt_stats():
    from podsrl.prompt_stats import PromptStats

    stats = PromptStats()
    mixed, right, wrong = [True, False] * 4, [True] * 8, [False] * 8
    for uid, visits in {"B": [mixed, right, right], "C": [wrong] * 3, "D": [right, mixed], "E": [right] * 8}.items():
        for bits in visits:
            visit(stats, uid, bits)
    easy, hard = stats.streaks(["A", "B", "C", "D", "E"])
    assert easy.tolist() == EASY.tolist() and hard.tolist() == HARD.tolist()
    # checkpoint round trip, and an older checkpoint without streaks loads as "no streak"
    again = PromptStats()
    again.load_state_dict(stats.state_dict())
    assert [t.tolist() for t in again.streaks(["B", "C"])] == [[2, 0], [0, 3]]
    old = {k: v for k, v in stats.state_dict().items() if k in ("uids", "successes", "attempts")}
    legacy = PromptStats()
    legacy.load_state_dict(old)
    assert legacy.streaks(["B"])[0].tolist() == [0] and legacy.recent("B") == []


def test_method_skips_and_replaces_from_the_sampler():
    from podsrl.methods.greso import Greso
    from tests.method_helpers import ScriptedContext, problems

    pool = problems(12)
    cfg = greso_config()
    ctx = ScriptedContext(cfg, lambda uid, k: True, seed=3, pool=pool[4:])
    for p in pool[:4]:  # the step's four prompts were all-correct on their last 20 visits: p = 1 - 0.01 each
        for _ in range(20):
            visit(ctx.stats, p.uid, [True] * 8)
    method = Greso(cfg)
    batch, metrics = method.collect(pool[:4], ctx)
    uids = [p.uid for p in batch.problems]
    assert len(uids) == 4 and batch.num_rollouts == 32
    assert ctx.calls == [(uids, [8] * 4)]
    skipped = 4 - sum(u in {"p0", "p1", "p2", "p3"} for u in uids)
    assert skipped >= 3, "skip probability 0.99 each"
    assert metrics["examples/scan_exhausted"] == 0.0
    out = method.end_step([batch], ctx)
    assert out["examples/skipped_easy"] == skipped and out["examples/skipped_hard"] == 0
    assert out["examples/kept"] == 4 and out["examples/too_easy_ratio"] == 1.0
    # the same seed and history give the same decisions
    ctx3 = ScriptedContext(cfg, lambda uid, k: True, seed=3, pool=pool[4:])
    ctx3.stats.load_state_dict(ctx.stats.state_dict())
    again, _ = Greso(cfg).collect(pool[:4], ctx3)
    assert [p.uid for p in again.problems] == uids


def test_method_scan_bound():
    from podsrl.methods.greso import Greso
    from tests.method_helpers import ScriptedContext, problems

    pool = problems(4)
    cfg = greso_config(**{"greso.max_scan": 0.5, "greso.min_keep": 0.0001})
    ctx = ScriptedContext(cfg, lambda uid, k: False, pool=pool)
    for p in pool:
        for _ in range(30):
            visit(ctx.stats, p.uid, [False] * 8)
    method = Greso(cfg)
    batch, metrics = method.collect(pool, ctx)
    assert ctx.position == 2, "at most max_scan * 4 = 2 replacement draws"
    assert metrics["examples/scan_exhausted"] == 1.0 and batch.num_groups >= 1
    out = method.end_step([batch], ctx)
    assert out["examples/kept"] == batch.num_groups, "a forced roll-out counts as kept, not skipped"
    assert out["examples/skipped_hard"] + out["examples/kept"] == 6


def test_method_adaptation_gate_and_state():
    from podsrl.methods.greso import Greso
    from tests.method_helpers import ScriptedContext, problems, scored_batch

    cfg = greso_config()
    # 100 groups of 8: 20 all-wrong, 5 all-correct, 75 mixed
    bits = [False] * 8 * 20 + [True] * 8 * 5 + [True, False] * 4 * 75
    batch = scored_batch(problems(100), list(range(100)), [8] * 100, bits)
    method = Greso(cfg)
    out = method.end_step([batch], ScriptedContext(cfg, lambda u, k: True, epoch=0))
    assert (out["examples/p_easy"], out["examples/p_hard"]) == (0.5, 0.5)
    assert out["examples/too_hard_ratio"] == 0.2 and out["examples/too_easy_ratio"] == 0.05
    out = method.end_step([batch], ScriptedContext(cfg, lambda u, k: True, epoch=1))
    assert (out["examples/p_easy"], out["examples/p_hard"]) == (0.51, 0.49)
    restored = Greso(cfg)
    restored.load_state_dict(method.state_dict())
    assert (restored.p_easy, restored.p_hard) == (0.51, 0.49)


def test_method_refill_count_and_config_errors():
    from podsrl.errors import ConfigError
    from podsrl.methods.greso import Greso

    method = Greso(greso_config(**{"rollout.prompts_per_step": 32}))
    assert method.refill_count(10, 0.5) == 25  # int(10 / 0.5 * 1.25), within [8, 48]
    assert method.refill_count(30, 0.5) == 48 and method.refill_count(1, 0.0) == 8
    assert method.refill_count(3, 1.0) == 48
    with pytest.raises(ConfigError, match="greso.p_init"):
        greso_config(**{"greso.p_init": 0.99})
    with pytest.raises(ConfigError, match="greso.refill_min"):
        greso_config(**{"greso.refill_min": 2.0})


def test_trains_end_to_end(tmp_path, warmup_cache):
    from tests.method_helpers import train_preset

    # groups of 2 with a hashed correctness: half the visits are all-correct or all-wrong, so streaks build up
    steps = train_preset("greso", tmp_path / "run", warmup_cache, **{"filter.max_refill_rounds": 2,
                                                                      "train.max_steps": 8, "rollout.n": 2})
    assert len(steps) == 8
    for r in steps:
        # every prompt rolled out got n = 2, and at most prompts_per_step informative groups train
        assert r["rollouts/generated"] == 2 * r["examples/total_sampled"]
        assert r["examples/kept"] == r["examples/total_sampled"]
        assert r["rollouts/trained"] <= 8 and r["select/groups_trained"] <= 4
        assert 0.05 <= r["examples/p_easy"] <= 0.95 and 0.05 <= r["examples/p_hard"] <= 0.95
    assert sum(r["examples/skipped_easy"] + r["examples/skipped_hard"] for r in steps) > 0
    assert steps[0]["examples/skipped_easy"] + steps[0]["examples/skipped_hard"] == 0, "no history at step 1"


@pytest.mark.parametrize("skip, skipped", [("both", (3, 4)), ("easy", (4, 0)), ("hard", (0, 4))])
def test_skip_switch_limits_which_streaks_skip(skip, skipped):
    """greso.skip=easy never skips an all-wrong streak (and =hard never an all-correct one): the ablation that
    tests whether skipping unsolved prompts is what costs pass@k."""
    from podsrl.methods.greso import Greso
    from tests.method_helpers import ScriptedContext, problems

    pool = problems(8)
    # 20-visit streaks with a negligible floor: every eligible prompt is skipped (probability 1 - 0.5^20)
    cfg = greso_config(**{"greso.skip": skip, "greso.max_scan": 0, "greso.min_keep": 1e-9,
                          "rollout.prompts_per_step": 8})
    ctx = ScriptedContext(cfg, lambda uid, k: True, seed=5, pool=[])
    for i, p in enumerate(pool):  # p0-p3 all-correct, p4-p7 all-wrong on their last 20 visits
        for _ in range(20):
            visit(ctx.stats, p.uid, [i < 4] * 8)
    method = Greso(cfg)
    batch, _ = method.collect(pool, ctx)
    out = method.end_step([batch], ctx)
    # with both, all eight are skipped and the first (p0, easy) is rolled out anyway, counted as kept
    assert (out["examples/skipped_easy"], out["examples/skipped_hard"]) == skipped
    assert out["examples/kept"] == 8 - sum(skipped) == batch.num_groups


# ------------------------------------------------------------------------------ rules a mutation would change


def test_adaptation_at_exactly_the_target_skips_more():
    assert adapt_exploration(0.5, 0.25, 0.25, **STEP) == 0.49  # ratio >= target: p falls
    assert adapt_exploration(0.5, 0.25 - 1e-9, 0.25, **STEP) == 0.51


def test_easy_target_is_a_third_and_hard_two_thirds_of_the_zero_variance_target():
    """1 all-correct and 1 all-wrong group of 8: a share of 0.125 sits above T/3 = 0.083 and below 2T/3 = 0.167
    (T = 0.25), so p_easy falls and p_hard rises; swapped targets would do the opposite."""
    from podsrl.methods.greso import Greso
    from tests.method_helpers import ScriptedContext, problems, scored_batch

    cfg = greso_config(**{"rollout.n": 2})
    bits = [True, True, False, False] + [True, False] * 6  # group 0 all correct, group 1 all wrong, 6 mixed
    batch = scored_batch(problems(8), list(range(8)), [2] * 8, bits)
    out = Greso(cfg).end_step([batch], ScriptedContext(cfg, lambda u, k: True, epoch=1))
    assert (out["examples/too_easy_ratio"], out["examples/too_hard_ratio"]) == (0.125, 0.125)
    assert (out["examples/p_easy"], out["examples/p_hard"]) == (0.49, 0.51)


def test_a_visit_with_one_success_ends_the_hard_streak():
    from podsrl.prompt_stats import PromptStats

    stats = PromptStats()
    visit(stats, "a", [False] * 8)
    visit(stats, "a", [False] * 8)
    assert stats.streaks(["a"])[1].tolist() == [2]
    visit(stats, "a", [True] + [False] * 7)
    assert [s.tolist() for s in stats.streaks(["a"])] == [[0], [0]]
    visit(stats, "a", [False] * 8)
    assert stats.streaks(["a"])[1].tolist() == [1]


def test_refill_min_zero_with_a_small_scale_still_draws_a_prompt():
    from podsrl.methods.greso import Greso

    method = Greso(greso_config(**{"rollout.prompts_per_step": 32, "greso.refill_min": 0, "greso.refill_scale": 0.5}))
    assert method.refill_count(1, 0.0) == 1  # int(1 * 0.5) = 0 would draw nothing (and collect([]) fails)


class _RefillLoop:
    """The parts of the producer that its zero-variance refill loop uses, with scripted rounds: round r rolls out
    its prompts with `live[r]` groups carrying variance (mixed) and the rest all wrong."""

    def __init__(self, cfg, live: list[int]):
        from podsrl.methods.greso import Greso

        self.cfg, self.method, self.live, self.sizes = cfg, Greso(cfg), list(live), []
        self.tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()

    def _collect_and_select_once(self, batch_problems, ctx, record):
        from tests.method_helpers import scored_batch

        live, n = self.live.pop(0), self.cfg.rollout.n
        self.sizes.append(len(batch_problems))
        bits = [[True] + [False] * (n - 1) if g < live else [False] * n for g in range(len(batch_problems))]
        batch = scored_batch(batch_problems, list(range(len(batch_problems))), [n] * len(batch_problems),
                             [b for group in bits for b in group])
        batch.advantages = torch.zeros(batch.num_rollouts)
        return batch, {}


def test_trainer_refill_uses_the_zero_variance_fraction_of_the_round_just_sampled():
    """The worked example: 32 prompts a step; round 1 has 24 groups with variance, the refill of 13
    (int(8 / 0.75 * 1.25)) has 1, so 7 are missing at a zero-variance fraction of 12/13: the reference draws
    int(7 * 13 * 1.25) = 113, clamped to 48. Over all rounds the fraction would be 20/45 and the draw 15."""
    from podsrl.run.producer import BatchProducer
    from tests.method_helpers import problems

    cfg = greso_config(**{"rollout.prompts_per_step": 32, "filter.zero_variance": True,
                          "filter.max_refill_rounds": 2})
    loop = _RefillLoop(cfg, live=[24, 1, 48])
    drawn = iter(range(32, 10_000))
    ctx = type("Context", (), {"draw": staticmethod(lambda count: problems(count, start=next(drawn)))})()
    kept, metrics = BatchProducer.collect_and_select(loop, problems(32), ctx, record=None)
    assert loop.sizes == [32, 13, 48]
    assert metrics["select/groups_trained"] == 32 and kept.num_groups == 32 + 13 + 48
