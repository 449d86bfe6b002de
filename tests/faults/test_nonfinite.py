"""Numerical faults: a non-finite loss/gradient skips that step's optimiser update (logged); after
train.max_nonfinite_steps in a row the run stops with one clear message and its checkpoints hold finite weights."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file

from podsrl.config import load_config
from podsrl.exit_codes import ExitCode
from podsrl.reporting.tracking import read_metrics
from podsrl.run.checkpoint import latest_checkpoint
from podsrl.run.trainer import Trainer
from tests.faults.common import error_line, tiny, train_argv


def _weights(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step-{step:08d}" / "model" / "model.safetensors")


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_step_is_skipped_and_the_run_goes_on(tmp_path, warm_cache, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("PODSRL_FAULTS", "nan@loss:2")
    overrides = tiny(run, warm_cache, **{"train.max_steps": 4, "train.save_every": 1, "train.keep_checkpoints": 5})
    Trainer(load_config("podsrl/configs/grpo.yaml", overrides)).train()
    steps = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "reward" in r}
    assert sorted(steps) == [1, 2, 3, 4] and (run / "summary.json").is_file()
    assert [steps[s]["train/nonfinite_skipped"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 0.0]
    assert steps[2]["loss"] is None and "grad_norm" not in steps[2]  # NaN logged as null; no optimiser step
    assert all(math.isfinite(steps[s]["grad_norm"]) for s in (1, 3, 4))
    assert _same(_weights(run, 1), _weights(run, 2))  # the skipped step left the weights alone
    assert not _same(_weights(run, 2), _weights(run, 3))  # and the next one trained normally
    assert all(torch.isfinite(t).all() for t in _weights(run, 4).values())


def test_consecutive_nan_steps_stop_the_run_with_a_clear_message(tmp_path, launcher, warm_cache):
    run = tmp_path / "run"
    argv = train_argv(run, warm_cache, **{"train.save_every": 1, "train.keep_checkpoints": 5,
                                          "train.max_nonfinite_steps": 3})
    result = launcher.run(argv, env={"PODSRL_FAULTS": "nan@loss:2-4"})
    assert result.code == ExitCode.UNHEALTHY  # not a config error: retrying the same settings fails the same way
    line = error_line(result.stderr)
    assert "3 consecutive steps with a non-finite loss or gradient (step 4)" in line
    assert str(run / "checkpoints") in line
    assert latest_checkpoint(run).name == "step-00000003"
    assert _same(_weights(run, 3), _weights(run, 1))  # nothing non-finite ever reached the weights
    assert all(torch.isfinite(t).all() for t in _weights(run, 3).values())
    assert not (run / "summary.json").exists()
