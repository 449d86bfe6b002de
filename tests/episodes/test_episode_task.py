"""The built-in episode task (arithmetic with a calculator) trains end to end: a tiny Trainer runs 2 steps on it,
and with a scripted engine that calls the calculator, episodes go through the real producer (rewards, advantages)
into the update with the tool's tokens masked; a task without an environment keeps the single-turn path."""

from __future__ import annotations

import math

import torch

from podsrl.config import load_config
from podsrl.reporting.tracking import read_metrics
from podsrl.run.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.episodes.scripted import EOS_TEXT, ScriptedEngine
from tests.episodes.test_runner import calculator_script

EPISODES = {"task.name": "arithmetic_tool", "model.tiny.max_position_embeddings": 160, "rollout.max_new_tokens": 16,
            "episode.max_tokens": 128, "episode.max_turns": 3, "optim.epochs": 2, "warmup.episode_steps": 3,
            "warmup.validation_size": 8}


def train_two_episode_steps(run_dir, overrides: list[str]) -> list[dict]:
    """Train a tiny run of 2 steps of episodes; the steps' metrics, checked to be those of episodes."""
    trainer = Trainer(load_config(None, overrides))
    assert trainer.parts.producer.episodes is not None
    trainer.train()
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["episode/turns"] >= 1 and math.isfinite(r["loss"])
    return steps


def test_a_tiny_trainer_runs_two_steps_of_episodes(tmp_path, warmup_cache):
    steps = train_two_episode_steps(tmp_path, tiny_overrides(tmp_path, warmup_cache, **EPISODES))
    for r in steps:
        assert sum(r[f"episode/ended_by_{e}"] for e in ("answer", "turns", "tokens", "environment_fault")) == 1.0


def right_on_even_seeds(context: str, seed: int) -> str:
    """The calculator script, its answer spoiled on odd seeds (the groups' rewards vary)."""
    text = calculator_script(context, seed)
    return text if seed % 2 == 0 or not text.endswith(EOS_TEXT) else "x" + text


def test_scripted_tool_episodes_go_through_the_producer_into_the_update(tmp_path, warmup_cache):
    overrides = tiny_overrides(tmp_path, warmup_cache, **{**EPISODES, "rollout.max_new_tokens": 96})
    trainer = Trainer(load_config(None, overrides))
    trainer.parts.producer.episodes.engine = ScriptedEngine(right_on_even_seeds)
    produced = trainer.parts.producer.produce(0)
    kept = produced.kept
    assert kept.loss_mask is not None and kept.loss_mask.shape == kept.completion_mask.shape
    tool_tokens = (kept.completion_mask - kept.loss_mask).sum(dim=1)
    assert bool((tool_tokens > 0).all())  # every episode read a tool's answer, masked from the loss
    assert all("<tool_response>" in c for c in kept.completions)
    assert 0 < float(kept.rewards.mean()) < 1 and bool((kept.advantages != 0).any())
    assert produced.metrics["episode/tool_calls/calculator"] == kept.num_rollouts
    assert produced.metrics["episode/turns"] == 2.0
    # generated tokens are the model's alone (TRL's count); the tool's answers are the environment's, apart
    every = produced.generated
    assert produced.generated_tokens == sum(int(b.loss_mask.sum()) for b in every)
    assert produced.environment_tokens == sum(int((b.completion_mask - b.loss_mask).sum()) for b in every) > 0
    before = [p.detach().clone() for p in trainer.parts.model.parameters()]
    metrics = trainer.parts.updater.update(kept, torch.Generator().manual_seed(0))
    assert math.isfinite(metrics["loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.parts.model.parameters()))
    trainer.close_engines()


def test_a_task_without_an_environment_samples_single_turn(tmp_path, warmup_cache):
    trainer = Trainer(load_config(None, tiny_overrides(tmp_path, warmup_cache)))
    assert trainer.parts.producer.episodes is None
    produced = trainer.parts.producer.produce(0)
    assert produced.kept.loss_mask is None and not any(k.startswith("episode/") for k in produced.metrics)
    trainer.close_engines()
