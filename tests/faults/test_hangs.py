"""Nothing hangs a run: `podsrl train` processes whose environment hangs for good in `reset`, in `step` or in a tool
call, stopped by SIGTERM (the last completed step checkpointed, exit 75) or by a double Ctrl-C (exit 130, or 75
where the first one's stop was done before the second arrived), exit within seconds. The processes end as an
interpreter does (tests/faults/launcher.py's interpreter_exit): exit must not wait for the threads still stuck in
the user's code."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from podsrl.run.checkpoint import latest_checkpoint
from tests.faults.common import last_step

STEP = 4  # episodes a step: 2 prompts x 2 rollouts; the second step's hang
EXIT_WITHIN_S = 30.0  # bounded, with room for a loaded machine (they take ~1 s)


def train_argv(run: Path, hang: str) -> list[str]:
    overrides = {
        "output_dir": run, "task.name": "hanging", "task.eval_size": 0, "warmup.steps": 0, "seed": 3,
        "task.args": f"{{hang: {hang}, hang_after: {STEP}, mark: '{run.parent / 'hanging'}', operands: 2, digits: 1}}",
        "method": "grpo", "model.tiny.num_layers": 1, "model.tiny.hidden_size": 32, "model.tiny.num_heads": 2,
        "model.tiny.intermediate_size": 64, "rollout.prompts_per_step": 2, "rollout.n": 2,
        "rollout.max_new_tokens": 8, "episode.max_turns": 2, "episode.max_tokens": 40,
        "episode.env_timeout_s": 300, "episode.tool_timeout_s": 300, "train.max_steps": 5, "train.save_every": 100,
        "train.eval_every": 100, "log.progress": False, "log.tensorboard": False, "log.plot": False,
    }
    return ["train", *(f"{k}={v}" for k, v in overrides.items())]


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGINT", "SIGINT")], ids=["sigterm", "double-sigint"])
@pytest.mark.parametrize("hang", ["step", "reset", "tool"])
def test_a_run_whose_environment_hangs_stops_on_a_signal(tmp_path, launcher, hang, signals):
    run = tmp_path / "run"
    child = launcher.start(train_argv(run, hang), module="tests.faults.hanging_envs", interpreter_exit=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "hanging").exists():  # the second step's first call has started to hang
            assert child.poll() is None, child.stderr()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        assert last_step(run) == 1 and child.poll() is None
        sent = time.monotonic()
        for name in signals:
            child.signal(getattr(signal, name))
            time.sleep(0.01)
        result = child.wait(EXIT_WITHIN_S)
        took = time.monotonic() - sent
    finally:
        child.signal(signal.SIGKILL)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if result.code == 75:  # stopped: the step the hang abandoned is redone on resume, from step 1's checkpoint
        assert latest_checkpoint(run).name == "step-00000001" and "stopped by signal at step 1" in result.stderr
    else:
        assert len(signals) == 2 and result.code == 130 and "podsrl: interrupted" in result.stderr, result
    print(f"{hang} {'+'.join(signals)}: exit {result.code} {took:.2f} s after the signal")
