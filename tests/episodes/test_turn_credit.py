"""Turn-level credit (`episode.credit: turn`, podsrl/episodes/credit.py) against a hand-worked example, and through
the producer and the update with an environment whose steps give turn rewards (tests/fixtures/countdown_env.py)."""

from __future__ import annotations

import math

import pytest
import torch

from podsrl.config import load_config
from podsrl.episodes.credit import turn_credit, turn_returns
from podsrl.run.trainer import Trainer
from tests.episodes.scripted import ScriptedEngine
from tests.episodes.test_environment_task import COUNTDOWNS, count_down, overrides
from tests.episodes.test_episode_task import train_two_episode_steps

# Group 0: row 0 took 3 turns (turn rewards 0.2, 0, 0.3; episode reward 1.0, so 0.5 not given per turn: counted at
# its last turn), row 1 one turn (reward 0). Group 1 is constant (both rewards 0.5): no advantage, no shift.
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5])
TURN_REWARDS = torch.tensor([[0.2, 0.0, 0.3], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
GROUPS = torch.tensor([0, 0, 1, 1])
# row 0's tokens: turn 0 (2 model tokens, 1 environment token), turn 1 (1 + 1), turn 2 (2 model tokens)
TURN_INDEX = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
ADVANTAGES = torch.tensor([0.7, -0.7, 0.0, 0.0])  # the method's, whatever it is: kept as the base
SIGMA = math.sqrt(0.5)  # group 0's unbiased reward std: sqrt(((1 - .5)^2 + (0 - .5)^2) / 1)


def test_returns_by_hand():
    turns = torch.tensor([3, 1, 2, 1])
    # discount 1: G_2 = 0.3 + 0.5 = 0.8, G_1 = 0 + 0.8, G_0 = 0.2 + 0.8 = 1.0 (the episode's reward)
    g = turn_returns(REWARDS, TURN_REWARDS, turns, 1.0)
    assert g[0].tolist() == pytest.approx([1.0, 0.8, 0.8])
    assert g[1].tolist() == pytest.approx([0.0, 0.0, 0.0])
    assert g[2].tolist() == pytest.approx([0.5, 0.0, 0.0])  # 0.5 at turn 0, nothing left to give turn 1
    # discount 0.5: G_2 = 0.8, G_1 = 0 + 0.5 * 0.8 = 0.4, G_0 = 0.2 + 0.5 * 0.4 = 0.4
    assert turn_returns(REWARDS, TURN_REWARDS, turns, 0.5)[0].tolist() == pytest.approx([0.4, 0.4, 0.8])


def test_token_advantages_by_hand():
    got = turn_credit(ADVANTAGES, REWARDS, GROUPS, 2, TURN_INDEX, TURN_REWARDS, 1.0, "group", 0.0)
    # row 0: turn 0 keeps A = 0.7; turns 1 and 2 lose turn 0's 0.2: 0.7 + (0.8 - 1.0) / sigma
    late = 0.7 - 0.2 / SIGMA
    assert got[0].tolist() == pytest.approx([0.7, 0.7, 0.7, late, late, late, late], abs=1e-6)
    assert got[1].tolist() == pytest.approx([-0.7] * 7, abs=1e-6)  # one turn: its advantage on every token
    assert got[2:].abs().max() == 0  # a constant group: nothing to shift
    half = turn_credit(ADVANTAGES, REWARDS, GROUPS, 2, TURN_INDEX, TURN_REWARDS, 0.5, "group", 0.0)
    # discount 0.5: (G - R) / sigma = (0.4 - 1) / sigma on turns 0-1, (0.8 - 1) / sigma on turn 2
    early, last = 0.7 - 0.6 / SIGMA, 0.7 - 0.2 / SIGMA
    assert half[0].tolist() == pytest.approx([early] * 5 + [last] * 2, abs=1e-6)
    # algo.scale none: the shift in reward units
    assert turn_credit(ADVANTAGES, REWARDS, GROUPS, 2, TURN_INDEX, TURN_REWARDS, 1.0, "none", 0.0)[0, 3] \
        == pytest.approx(0.7 - 0.2)


def test_the_producer_credits_each_countdown_turn_from_its_turn_on(tmp_path, warmup_cache):
    trainer = Trainer(load_config(None, overrides(tmp_path, warmup_cache, "Countdown", COUNTDOWNS,
                                                  **{"episode.credit": "turn", "method": "grpo"})))
    trainer.parts.producer.episodes.engine = ScriptedEngine(count_down)
    kept = trainer.parts.producer.produce(0).kept
    assert kept.token_advantages is not None and kept.token_advantages.shape == kept.completion_mask.shape
    checked = 0
    for row in range(kept.num_rollouts):
        group = kept.group_index == kept.group_index[row]
        sigma = float(kept.rewards[group].std()) + trainer.cfg.algo.advantage_epsilon
        trained = kept.trained_mask[row] > 0
        turns = kept.turn_index[row][trained]
        adv = kept.token_advantages[row][trained]
        start = int(kept.problems[int(kept.group_index[row])].answer)
        assert adv[turns == 0].tolist() == pytest.approx([float(kept.advantages[row])] * int((turns == 0).sum()))
        if sigma > trainer.cfg.algo.advantage_epsilon and int(turns.max()) >= 1:  # a later turn: turn 0's 1/n gone
            want = float(kept.advantages[row]) - (1.0 / start) / sigma
            assert adv[turns == 1].tolist() == pytest.approx([want] * int((turns == 1).sum()), abs=1e-5)
            checked += 1
    assert checked
    trainer.close_engines()


@pytest.mark.slow  # about 15 s on a shared 2-core machine
def test_a_tiny_trainer_trains_with_turn_credit(tmp_path, warmup_cache):
    train_two_episode_steps(tmp_path, overrides(tmp_path, warmup_cache, "Countdown", COUNTDOWNS,
                                                **{"episode.credit": "turn", "episode.turn_discount": 0.9}))


def test_credit_leaves_the_warm_up_cache_key_alone():
    """The warm-up reads no advantage: both credit modes (and runs from before the keys) share its cached weights."""
    from podsrl.run.warmup import warmup_key

    plain = load_config("configs/arithmetic_tool.yaml")
    turn = load_config("configs/arithmetic_tool.yaml", ["episode.credit=turn", "episode.turn_discount=0.5"])
    assert warmup_key(plain) == warmup_key(turn)
