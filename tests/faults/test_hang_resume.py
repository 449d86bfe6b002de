"""A signal while a step's episodes hang in their environment checkpoints the last completed step, and the run
resumed from it equals the run that never hung (every record but time/*, and the final weights), synchronously and
under train.async: the abandoned step leaves the producer as it was before it (data position, RNG stream,
per-prompt history), so its episodes are regenerated exactly."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

import podsrl.tasks
from podsrl.config import load_config
from podsrl.run.checkpoint import latest_checkpoint
from podsrl.run.trainer import Trainer
from tests.faults.common import assert_same_run, last_step

STEP = 4  # episodes a step
NEVER = 10**9
ASYNC = {"train.async.enabled": True, "train.async.max_staleness": 1, "train.async.generator_threads": 1}


@pytest.fixture(autouse=True)
def hanging_task(monkeypatch):
    monkeypatch.setitem(podsrl.tasks.TASKS, "hanging", ("tests.faults.hanging_envs:HangingTask",
                                                       "a test's hanging environment"))


def config(run: Path, hang_after: int, **extra):
    overrides = {
        "output_dir": run, "task.name": "hanging", "task.eval_size": 0, "warmup.steps": 0, "seed": 5,
        "task.args": f"{{hang: step, hang_after: {hang_after}, mark: '{run.parent / 'hanging'}', operands: 2, "
                     "digits: 1}", "method": "grpo", "model.tiny.num_layers": 1, "model.tiny.hidden_size": 32,
        "model.tiny.num_heads": 2, "model.tiny.intermediate_size": 64, "rollout.prompts_per_step": 2,
        "rollout.n": 2, "rollout.max_new_tokens": 8, "episode.max_turns": 2, "episode.max_tokens": 40,
        "episode.env_timeout_s": 300, "train.max_steps": 4, "train.save_every": 100, "train.eval_every": 100,
        "log.progress": False, "log.tensorboard": False, "log.plot": False, **extra,
    }
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def signal_when_hung(mark: Path) -> threading.Thread:
    def watch() -> None:
        while not mark.exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("extra", [{}, ASYNC], ids=["sync", "async"])
def test_a_signal_during_a_hung_step_checkpoints_the_last_completed_one_and_resumes_exactly(tmp_path, extra):
    reference, run = tmp_path / "reference" / "run", tmp_path / "killed" / "run"
    Trainer(config(reference, NEVER, **extra)).train()
    trainer = Trainer(config(run, 2 * STEP, **extra))  # the third step's episodes hang in their first step
    watcher = signal_when_hung(run.parent / "hanging")
    start = time.monotonic()
    trainer.train()
    watcher.join(5)
    assert trainer.stopped_by_signal and time.monotonic() - start < 120
    assert last_step(run) == 2 and latest_checkpoint(run).name == "step-00000002"  # written by the stop
    Trainer(config(run, NEVER, **extra), resume=True).train()
    assert_same_run(run, reference)
