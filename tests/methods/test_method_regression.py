"""The redesigned loop reproduces, for every method preset, the per-step metrics recorded before the redesign
(tests/method_regression.py records them; re-record only for a deliberate change of numbers, and say so).

What must be exact is compared exactly: the steps' decisions and counts (sampled tokens, kept rollouts, allocations,
rounds, refills, steps) do not depend on the order in which floats are summed. What the model's forward and
backward sum in float32 does: another CPU (AVX-512 adds 16 floats at a time where AVX2 adds 8), another thread count
or oneDNN's kernels reorder those sums, and their last bits move (1.3e-6 relative seen between AVX2 and scalar
kernels on the same machine). Those aggregates are compared within the worst-case error of one float32 sum of the
longest length in these runs, Higham's gamma_n = n * u with u = 2**-24 (see FLOAT32_SUM_LENGTH)."""

import json
import math

import pytest

from tests.method_regression import CASES, FIXTURE, RECORDED_ON, run_case

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only("compares with metrics recorded on CPU")]

# The longest float32 sum of these runs: a weight's gradient sums over every position of a micro-batch, at most
# 32 trained rollouts x 12 positions (prompt and 4-token completion, padded) = 384 terms; rounded up to 512.
FLOAT32_SUM_LENGTH = 512
FLOAT32_TOLERANCE = FLOAT32_SUM_LENGTH * 2.0**-24  # ~3.1e-5: relative, and absolute for means of terms of size <= 1
# Metrics that are float32 sums of the model's outputs or of per-rollout rewards; every other metric is a decision
# or a count and must match exactly.
FLOAT32_AGGREGATES = {"loss", "grad_norm", "entropy", "reward", "reward_std", "correct"}
FLOAT32_AGGREGATE_PREFIXES = ("grad/", "modulation/", "clip_ratio/", "critic/", "select/reward_std_")


def is_float32_aggregate(key: str) -> bool:
    reward_moment = key.startswith("rewards/") and key.endswith(("/mean", "/std"))
    return key in FLOAT32_AGGREGATES or key.startswith(FLOAT32_AGGREGATE_PREFIXES) or reward_moment


def matches(key: str, got: float, recorded: float) -> bool:
    if is_float32_aggregate(key):
        return math.isclose(got, recorded, rel_tol=FLOAT32_TOLERANCE, abs_tol=FLOAT32_TOLERANCE)
    return got == recorded


@pytest.mark.parametrize("case", list(CASES))
def test_case_reproduces_the_recorded_metrics(tmp_path, warmup_cache, case):
    expected = json.loads(FIXTURE.read_text())[case]
    got = run_case(case, str(tmp_path / case), warmup_cache)
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected), start=1):
        assert sorted(g) == sorted(e), (step, set(g) ^ set(e))
        for key, value in e.items():
            assert matches(key, g[key], value), (step, key, g[key], value)


def test_the_fixture_names_the_machine_it_was_recorded_on():
    recorded_on = json.loads(FIXTURE.read_text())[RECORDED_ON]
    assert {"cpu", "cpu_capability", "torch", "threads", "date"} <= set(recorded_on)


def test_the_comparison_tells_counts_from_float32_sums():
    assert matches("grad_norm", 2.1701663, 2.1701622)  # 1.9e-6 apart: seen between two CPU types
    assert not matches("grad_norm", 2.1701663, 2.1711622)  # 4.6e-4 apart: a change of numbers
    assert matches("loss", -4e-8, 0.0)  # a near-zero mean: absolute
    assert not matches("rollouts/trained", 8.000001, 8.0)
    assert not matches("rewards/correct/errors", 1.0, 0.99999)
    assert not matches("rewards/invalid_rollouts", 1.0, 0.99999)
    assert matches("rewards/digits/mean", 0.34375001, 0.34375)
    assert not matches("select/groups_trained", 2.0000001, 2.0)
