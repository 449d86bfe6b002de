"""GRPO numerics against hand-computed values: advantages (unequal groups, three scalings), clipped loss,
the three aggregations, k3 KL, and the update's gradient equal to one big batch whatever the micro-batching."""

import math

import pytest
import torch

from podsrl.algo.advantages import grpo_advantages
from podsrl.algo.group_stats import group_outcomes
from podsrl.algo.loss import LOSS_AGGREGATIONS, aggregation_stats, clipped_policy_loss, k3_kl
from tests.conftest import device_under_test


def test_group_outcomes_interleaved_rows_and_an_empty_group_by_hand():
    device = device_under_test()
    group_index = torch.tensor([2, 0, 2, 2, 0, 3], device=device)
    success = torch.tensor([True, False, False, True, False, True], device=device)
    attempts, successes = group_outcomes(group_index, success, num_groups=5)
    assert attempts.tolist() == [2, 0, 3, 1, 0]
    assert successes.tolist() == [0, 0, 2, 1, 0]
    assert attempts.dtype == successes.dtype == torch.long and attempts.device.type == device.type


def test_group_advantages_unequal_groups_by_hand():
    # group 0: [1, 0, 1] ; group 1: [0, 1] ; group 2: [5] (size 1 -> 0); rows interleaved
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    groups = torch.tensor([0, 1, 0, 1, 0, 2])
    adv = grpo_advantages(rewards, groups, 3, scale="group", epsilon=1e-4)
    std0 = math.sqrt(((1 - 2 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    std1 = math.sqrt(0.5)
    expected = [(1 - 2 / 3) / (std0 + 1e-4), (0 - 0.5) / (std1 + 1e-4), (0 - 2 / 3) / (std0 + 1e-4),
                (1 - 0.5) / (std1 + 1e-4), (1 - 2 / 3) / (std0 + 1e-4), 0.0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)


def test_batch_and_none_scaling():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    centred = torch.tensor([0.5, -0.5, 1.0, -1.0])
    assert torch.allclose(grpo_advantages(rewards, groups, 2, scale="none"), centred)
    batch_std = rewards.std().item()
    assert torch.allclose(grpo_advantages(rewards, groups, 2, scale="batch", epsilon=1e-4),
                          centred / (batch_std + 1e-4), atol=1e-6)


def test_normalize_over_full_group_statistics():
    # kept subset [1, 0] of the generated group [1, 0, 0, 0]: statistics of the whole group
    kept = torch.tensor([1.0, 0.0])
    adv = grpo_advantages(kept, torch.tensor([0, 0]), 1, "group", 1e-4,
                          stats_rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), stats_group_index=torch.zeros(4).long())
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std().item()
    assert torch.allclose(adv, torch.tensor([0.75, -0.25]) / (std + 1e-4), atol=1e-6)


def test_zero_variance_group_gets_zero_advantage():
    adv = grpo_advantages(torch.ones(4), torch.zeros(4).long(), 1)
    assert torch.equal(adv, torch.zeros(4))


def test_clipped_loss_by_hand():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))  # ratios vs old log-prob 0
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, -2.0, 2.0]])
    loss, low, high = clipped_policy_loss(logp, old, adv, epsilon_low=0.2, epsilon_high=0.28)
    # A>0, rho=1.5 clipped at 1.28 -> -1.28 ; A<0, rho=0.5: min(-0.5*-1=0.5 , 0.8*-1... ) -> -min(-0.5,-0.8)=0.8
    expected = torch.tensor([[-1.28, 0.8, 2.2, -1.4]])
    assert torch.allclose(loss, expected, atol=1e-6)
    assert high.tolist() == [[True, False, False, False]]
    assert low.tolist() == [[False, True, False, False]]


def test_aggregations_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    per_token = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
    stats = aggregation_stats(mask, max_length=4)

    def agg(name):
        return float((LOSS_AGGREGATIONS[name](mask, stats) * per_token).sum())

    assert agg("token_mean") == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert agg("seq_mean_token_mean") == pytest.approx(((1 + 2 + 3) / 3 + 4 / 1) / 2)
    assert agg("seq_mean_token_sum_norm") == pytest.approx(((1 + 2 + 3) / 4 + 4 / 4) / 2)


def test_aggregation_weights_split_over_micro_batches_sum_to_the_whole():
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    stats = aggregation_stats(mask, 5)
    for fn in LOSS_AGGREGATIONS.values():
        whole = fn(mask, stats)
        parts = torch.cat([fn(mask[:2], stats), fn(mask[2:], stats)])
        assert torch.allclose(whole, parts)


def test_k3_kl_by_hand_and_nonnegative():
    p = torch.tensor([-1.0, -2.0])
    q = torch.tensor([-1.5, -1.0])
    d = q - p
    assert torch.allclose(k3_kl(p, q), torch.exp(d) - d - 1)
    assert float(k3_kl(p, p).abs().max()) == 0.0
    assert bool((k3_kl(torch.randn(100), torch.randn(100)) >= 0).all())
