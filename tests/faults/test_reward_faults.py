"""Reward faults through the trainer: a custom reward file that raises, hangs past the timeout, returns NaN / inf /
None / a string, or the wrong number of values. Policy zero and skip: the run goes on, each fault counted in that
step's metrics; policy fail: the run stops with one clear message and its last checkpoint intact."""

from __future__ import annotations

import math

import pytest

from podsrl.config import load_config
from podsrl.errors import UserError
from podsrl.reporting.tracking import read_metrics
from podsrl.run.checkpoint import latest_checkpoint
from podsrl.run.trainer import Trainer
from tests.faults.common import REWARDS, error_line, tiny, train_argv

R = 16  # rollouts per step: 4 prompts x 4
KINDS = ["raise", "hang", "count", "nan", "inf", "none", "str"]
# (metric counted, rows affected) per kind: whole-call faults hit all R rows, per-value faults every other row
EXPECTED = {"raise": ("errors", R), "hang": ("timeouts", R), "count": ("invalid", R), "nan": ("invalid", R // 2),
            "inf": ("invalid", R // 2), "none": ("invalid", R // 2), "str": ("invalid", R // 2)}
MESSAGES = {"raise": "raised ValueError: injected reward failure", "hang": "did not return within 0.3 s",
            "count": f"returned {R - 1} values for {R} completions",
            **{k: "returned a value that is None, NaN, inf or not a number" for k in ("nan", "inf", "none", "str")}}


def _overrides(run, cache, policy: str, steps: int) -> list[str]:
    rewards = f"[{{name: correct}}, {{name: faulty, function: '{REWARDS}:faulty'}}]"
    return tiny(run, cache, **{"rewards": rewards, "reward_on_error": policy, "reward_timeout": 0.3,
                               "method": "grpo", "train.max_steps": steps,
                               "train.save_every": 1, "train.eval_every": 100})


def _train(run, cache, policy: str, modes: list[str], monkeypatch) -> list[dict]:
    monkeypatch.setenv("FAULTY_REWARD", ",".join(modes))
    monkeypatch.setenv("FAULTY_REWARD_HANG", "1.0")
    Trainer(load_config("podsrl/configs/grpo.yaml", _overrides(run, cache, policy, len(modes)))).train()
    return [r for r in read_metrics(run / "metrics.jsonl") if "reward" in r]


@pytest.mark.parametrize("policy", ["zero", "skip"])
def test_every_fault_is_counted_and_the_run_goes_on(tmp_path, warm_cache, monkeypatch, policy):
    modes = ["ok", *KINDS]
    steps = _train(tmp_path / "run", warm_cache, policy, modes, monkeypatch)
    assert [r["step"] for r in steps] == list(range(1, len(modes) + 1))  # every step ran
    assert (tmp_path / "run" / "summary.json").is_file()
    for record, mode in zip(steps, modes):
        counted = {k: record[f"rewards/faulty/{k}"] for k in ("errors", "timeouts", "invalid")}
        kind, rows = EXPECTED.get(mode, (None, 0))
        assert counted == {k: float(rows if k == kind else 0) for k in counted}, (mode, counted)
        assert record["rollouts/generated"] == R
        if policy == "zero":  # faulty values count as 0 and every rollout is trained
            assert record["rewards/invalid_rollouts"] == 0 and record["rollouts/trained"] == R
            if rows == R:
                assert record["rewards/faulty/mean"] == 0.0
        else:  # the affected rollouts are dropped before the update
            assert record["rewards/invalid_rollouts"] == rows
            assert record["rollouts/trained"] == R - rows
        if rows == R and policy == "skip":
            assert record.get("loss") is None  # nothing left to train on: no update this step
        else:
            assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])


@pytest.mark.parametrize("kind", KINDS)
def test_policy_fail_stops_with_one_clear_message_and_keeps_the_checkpoint(tmp_path, warm_cache, monkeypatch,
                                                                         kind):
    run = tmp_path / "run"
    with pytest.raises(UserError) as info:
        _train(run, warm_cache, "fail", ["ok", "ok", kind], monkeypatch)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("reward function 'faulty' ") and MESSAGES[kind] in message
    assert "first affected: problem uid=" in message
    assert latest_checkpoint(run).name == "step-00000002"  # the steps before the fault are safe
    assert not (run / "summary.json").exists()


def test_policy_fail_through_the_cli_exits_2(tmp_path, launcher, warm_cache):
    run = tmp_path / "run"
    rewards = f"[{{name: correct}}, {{name: faulty, function: '{REWARDS}:faulty'}}]"
    argv = train_argv(run, warm_cache, rewards=rewards, reward_on_error="fail")
    result = launcher.run(argv, env={"FAULTY_REWARD": "ok,ok,ok,raise"})
    assert result.code == 2
    assert "reward function 'faulty' raised ValueError: injected reward failure" in error_line(result.stderr)
    assert latest_checkpoint(run).name == "step-00000002"
