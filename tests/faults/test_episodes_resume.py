"""Episodes resume exactly: a run of the episode task (arithmetic with a calculator) killed while a step's episodes
are in flight (fault site `turn`: after a turn's tool calls, before the next turn), synchronously or with
train.async's batches generated ahead, and resumed, equals the unkilled run (every record but time/*, and the final
weights). A step's episodes are not checkpointed: they are regenerated from the step's saved producer state (data
position, RNG) and weights, and a row's turns are seeded by its own seed alone. Under train.async the batches
produced ahead, episodes included, are in the checkpoint with their loss masks."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from podsrl.config import load_config
from podsrl.run.checkpoint import latest_checkpoint, load_in_flight
from podsrl.run.trainer import Trainer
from podsrl.update import PolicyUpdater
from tests.faults.common import EPISODES, assert_same_run, last_step, records, resume_argv, tiny, train_argv

ASYNC = {"train.async.enabled": True, "train.async.max_staleness": 1, "train.async.generator_threads": 1}


@pytest.fixture(scope="module")
def episode_cache(warm_cache, tmp_path_factory):
    """The episode task's warm-up, trained once for the module (beside the plain one in the session's cache)."""
    from podsrl.run.warmup import run_warmup

    run_warmup(load_config(None, tiny(tmp_path_factory.mktemp("unused"), warm_cache, **EPISODES)), progress=False)
    return warm_cache


def config(run, cache, **extra):
    return load_config("podsrl/configs/grpo.yaml", tiny(run, cache, **EPISODES, **extra))


def assert_multi_turn(run) -> None:
    """Every step's episodes called the calculator and ran more than one turn on average: the kill lands between
    turns of live episodes, not after one-turn answers."""
    steps = [r for r in records(run) if "reward" in r]
    assert steps and all(r["episode/turns"] > 1 and r["episode/tool_calls/calculator"] > 0 for r in steps), steps


@pytest.mark.parametrize("run_ahead", [False, True], ids=["sync", "async"])
def test_sigkill_with_episodes_in_flight_resumes_exactly(tmp_path, launcher, episode_cache, run_ahead):
    extra = {**EPISODES, **(ASYNC if run_ahead else {})}
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert launcher.run(train_argv(reference, episode_cache, **extra)).code == 0
    assert_multi_turn(reference)
    # SIGKILL after the first turn of step 4's episodes, the checkpoint being step 2's. Synchronously step 3 is done
    # and logged; under train.async the generator runs step 4's episodes beside step 3's update, and the
    # checkpoint holds step 3's batch, generated ahead.
    result = launcher.run(train_argv(run, episode_cache, **extra), env={"PODSRL_FAULTS": "kill@turn:4"})
    assert result.code == -signal.SIGKILL, result.stderr[-3000:]
    assert last_step(run) in ((2, 3) if run_ahead else (3,)) and latest_checkpoint(run).name == "step-00000002"
    result = launcher.run(resume_argv(run))
    assert result.code == 0, result.stderr[-3000:]
    assert_same_run(run, reference)


@pytest.mark.slow  # three runs of about 7 s each
def test_sigkill_with_spaced_environment_text_resumes_exactly(tmp_path, launcher, warm_cache):
    """A TRL environment (tests/faults/spaced_env.py) on a dataset, its prompts and environment text with spaces: the
    resumed run tokenizes both with the checkpoint's tokenizer, which must give the killed run's ids."""
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?", "answer": a + b}) + "\n"
                            for a in range(1, 9) for b in (2, 5)), encoding="utf-8")
    env = Path(__file__).with_name("spaced_env.py")
    extra = {**EPISODES, "task.name": "trl_environment", "warmup.steps": 0, "task.eval_size": 4,
             "task.args": f"{{path: '{data}', environment: '{env}:SpacedSumsEnv'}}"}
    reference, run = tmp_path / "reference", tmp_path / "run"
    result = launcher.run(train_argv(reference, warm_cache, **extra))
    assert result.code == 0, result.stderr[-3000:]
    result = launcher.run(train_argv(run, warm_cache, **extra), env={"PODSRL_FAULTS": "kill@turn:4"})
    assert result.code == -signal.SIGKILL, result.stderr[-3000:]
    assert latest_checkpoint(run).name == "step-00000002"
    result = launcher.run(resume_argv(run))
    assert result.code == 0, result.stderr[-3000:]
    assert_same_run(run, reference)


@pytest.fixture
def updated_batches(monkeypatch):
    """The batches the learner updates on, as it got them (loss and completion masks)."""
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    update = PolicyUpdater.update

    def spy(self, batch, *args, **kwargs):
        seen.append((batch.completion_mask.clone(), None if batch.loss_mask is None else batch.loss_mask.clone()))
        return update(self, batch, *args, **kwargs)

    monkeypatch.setattr(PolicyUpdater, "update", spy)
    return seen


def test_async_episodes_train_model_tokens_and_resume_exactly_with_batches_in_flight(
        tmp_path, episode_cache, monkeypatch, updated_batches):
    Trainer(config(tmp_path / "straight", episode_cache, **ASYNC)).train()
    assert_multi_turn(tmp_path / "straight")
    # every batch reached the learner from the generator thread with its loss mask: tool tokens in the context,
    # out of the loss
    assert len(updated_batches) == 6 and all(loss is not None for _, loss in updated_batches)
    assert all(bool((loss <= present).all()) for present, loss in updated_batches)
    assert sum(float((present - loss).sum()) for present, loss in updated_batches) > 0
    # dies while the generator runs step 4's episodes (during step 3's update), after the step-2 checkpoint, which
    # holds step 3's batch generated ahead: episodes with tool answers, their mask saved
    monkeypatch.setenv("PODSRL_FAULTS", "raise@turn:4")
    with pytest.raises(RuntimeError, match="injected fault at turn:4"):
        Trainer(config(tmp_path / "crashed", episode_cache, **ASYNC)).train()
    monkeypatch.delenv("PODSRL_FAULTS")
    [ahead] = load_in_flight(latest_checkpoint(tmp_path / "crashed"))
    kept = ahead["kept"]
    assert kept["loss_mask"] is not None and float((kept["completion_mask"] - kept["loss_mask"]).sum()) > 0
    Trainer(config(tmp_path / "crashed", episode_cache, **ASYNC), resume=True).train()
    assert_same_run(tmp_path / "crashed", tmp_path / "straight")
