"""ComputeAccountant: per-step figures, running totals, checkpoint round trip."""

from __future__ import annotations

import json

import pytest
import torch

from podsrl.run.accounting import ComputeAccountant

TOTAL_KEYS = [
    "total/rollouts_generated",
    "total/rollouts_trained",
    "total/tokens_generated",
    "total/tokens_trained",
    "total/flops_generate_est",
    "total/flops_update_est",
]


def test_step_metrics_and_totals_by_hand():
    acc = ComputeAccountant(params=1000)
    m = acc.step(generated_rollouts=64, generated_tokens=5000, trained_rollouts=16, trained_tokens=1200)
    assert m["rollouts/generated"] == 64 and m["rollouts/trained"] == 16
    assert m["tokens/generated"] == 5000 and m["tokens/trained"] == 1200
    assert m["flops/generate_est"] == 2 * 1000 * 5000
    assert m["flops/update_est"] == 6 * 1000 * 1200
    assert m["flops/total_est"] == 2 * 1000 * 5000 + 6 * 1000 * 1200
    m = acc.step(32, torch.tensor(100), 8, torch.tensor(40), passes=2)
    assert m["flops/update_est"] == 6 * 1000 * 40 * 2
    assert [m[k] for k in TOTAL_KEYS] == [96, 24, 5100, 1240, 2000 * 5100, 6000 * 1200 + 12000 * 40]
    assert m["total/flops_est"] == m["total/flops_generate_est"] + m["total/flops_update_est"]
    assert acc.total_metrics() == {k: v for k, v in m.items() if k.startswith("total/")}
    assert all(isinstance(v, float) for v in m.values())


def test_totals_survive_state_dict_round_trip():
    steps = [(16, 900, 8, 400), (24, 1500, 8, 420), (20, 1100, 10, 600), (16, 700, 4, 100)]
    straight = ComputeAccountant(params=123_456_789)
    for s in steps:
        expected = straight.step(*s)

    first = ComputeAccountant(params=123_456_789)
    for s in steps[:2]:
        first.step(*s)
    saved = json.loads(json.dumps(first.state_dict()))  # must be JSON-able
    resumed = ComputeAccountant(params=123_456_789)
    resumed.load_state_dict(saved)
    assert resumed.total_metrics() == first.total_metrics()
    for s in steps[2:]:
        got = resumed.step(*s)
    assert got == expected and resumed.steps == 4


def test_large_totals_stay_exact():
    acc = ComputeAccountant(params=7_000_000_000)
    for _ in range(3):
        acc.step(1024, 10**6, 256, 3 * 10**5, passes=4)
    assert acc.state_dict()["totals"]["flops_update_est"] == 3 * 6 * 7_000_000_000 * 3 * 10**5 * 4


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="params"):
        ComputeAccountant(-1)
    acc = ComputeAccountant(10)
    with pytest.raises(ValueError, match="trained_tokens"):
        acc.step(1, 1, 1, -5)
    with pytest.raises(ValueError, match="parameters"):
        acc.load_state_dict(ComputeAccountant(11).state_dict())
    with pytest.raises(ValueError, match="lacks"):
        acc.load_state_dict({"params": 10, "steps": 0, "totals": {}})


def test_environment_tokens_are_counted_apart_from_generated_ones():
    acc = ComputeAccountant(params=1000)
    m = acc.step(generated_rollouts=8, generated_tokens=500, trained_rollouts=8, trained_tokens=800,
                 environment_tokens=300)
    assert m["tokens/generated"] == 500 and m["tokens/environment"] == 300
    assert m["flops/generate_est"] == 2 * 1000 * 500  # prefilled like a prompt: not in the estimate
    m = acc.step(8, 100, 8, 150, environment_tokens=50)
    assert m["total/tokens_generated"] == 600 and m["total/tokens_environment"] == 350
    old = {"params": 1000, "steps": 3, "totals": {k: v for k, v in acc.state_dict()["totals"].items()
                                                  if k != "tokens_environment"}}  # an older checkpoint's
    resumed = ComputeAccountant(params=1000)
    resumed.load_state_dict(old)
    assert resumed.total_metrics()["total/tokens_environment"] == 0.0
