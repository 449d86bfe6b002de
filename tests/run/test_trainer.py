"""End-to-end behaviour of the trainer on tiny CPU runs: it learns, it logs the agreed metrics, it is deterministic."""

import json
import logging
from pathlib import Path

import pytest
import torch

from podsrl.config import load_config
from podsrl.reporting.tracking import read_metrics
from podsrl.run.trainer import Trainer
from tests.conftest import tiny_overrides

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _steps(run_dir):
    return [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "reward" in r]


def test_reward_rises_on_a_learnable_reward(tmp_path, warmup_cache):
    # From a random model (no warm-up), GRPO must raise the share of '1' characters it writes.
    overrides = tiny_overrides(
        tmp_path / "run", warmup_cache, **{
            "warmup.steps": 0, "train.max_steps": 30, "optim.lr": 3e-3, "rollout.prompts_per_step": 8,
            "rollout.n": 8, "rollout.max_new_tokens": 6, "rewards": f"[{FIXTURES / 'rewards_ones.py'}:ones_share]",
            "train.eval_every": 30,
        })
    Trainer(load_config("podsrl/configs/grpo.yaml", overrides)).train()
    rewards = [r["reward"] for r in _steps(tmp_path / "run")]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, (first, last)


@pytest.mark.parametrize("preset", ["grpo", "pods"])
def test_step_records_carry_the_agreed_metrics(tmp_path, warmup_cache, preset):
    overrides = tiny_overrides(tmp_path / preset, warmup_cache, **{"rollout.n": 8, "pods.m": 4})
    summary = Trainer(load_config(f"podsrl/configs/{preset}.yaml", overrides)).train()
    records = read_metrics(tmp_path / preset / "metrics.jsonl")
    steps = [r for r in records if "reward" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in evals] == [0, 2]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "entropy", "grad_norm",
                "learning_rate", "time/generate", "time/score", "time/select", "time/update", "time/step",
                "rollouts/generated", "rollouts/trained", "tokens/generated", "tokens/trained",
                "total/rollouts_generated", "select/reward_std_before", "select/reward_std_after"):
        assert key in steps[-1], key
    trained = 4 * (4 if preset == "pods" else 8)
    assert steps[-1]["rollouts/generated"] == 4 * 8
    assert steps[-1]["rollouts/trained"] == trained
    assert summary["total/rollouts_generated"] == 2 * 32
    assert json.loads((tmp_path / preset / "summary.json").read_text())["step"] == 2


def test_same_seed_same_metrics(tmp_path, warmup_cache):
    def run(name):
        Trainer(load_config("podsrl/configs/pods.yaml", tiny_overrides(tmp_path / name, warmup_cache,
                                                                      **{"rollout.n": 8, "pods.m": 4}))).train()
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in _steps(tmp_path / name)]

    first = run("a")
    assert [r["step"] for r in first] == [1, 2]  # both steps logged, with what they learned from
    assert all({"reward", "loss", "grad_norm"} <= r.keys() for r in first), first
    assert first == run("b")


def test_the_engine_releases_its_kept_cache_before_each_update(tmp_path, warmup_cache, monkeypatch):
    """Generation's KV cache (kept between calls under CUDA graphs) is freed before the update, not beside it."""
    from podsrl.engines.fast import FastEngine
    from podsrl.update import PolicyUpdater

    events = []
    release, update = FastEngine.release, PolicyUpdater.update

    def spy_release(engine):
        events.append("release")
        release(engine)

    def spy_update(updater, *args, **kwargs):
        events.append("update")
        return update(updater, *args, **kwargs)

    monkeypatch.setattr(FastEngine, "release", spy_release)
    monkeypatch.setattr(PolicyUpdater, "update", spy_update)
    overrides = tiny_overrides(tmp_path, warmup_cache, **{"rollout.n": 8, "pods.m": 4})
    Trainer(load_config("podsrl/configs/pods.yaml", overrides)).train()
    updates = [i for i, event in enumerate(events) if event == "update"]
    assert len(updates) == 2 and all(events[i - 1] == "release" for i in updates)


def test_the_engine_releases_an_evals_state_after_it(tmp_path, warmup_cache, monkeypatch):
    """An eval's kept state (as many rows as the device held then) is freed after the eval, not carried into the
    next step's generation, where the memory plan counts only the training waves' (measured on an H200: 4 GiB kept
    from a 1,024-row eval into generation, docs/results.md)."""
    from podsrl.engines.fast import FastEngine
    from podsrl.run import trainer as trainer_module

    events = []
    release, evaluate, generate = FastEngine.release, trainer_module.evaluate, FastEngine.generate

    def spy_release(engine):
        events.append("release")
        release(engine)

    def spy_generate(engine, *args, **kwargs):
        events.append("generate")
        return generate(engine, *args, **kwargs)

    def spy_evaluate(*args, **kwargs):
        metrics = evaluate(*args, **kwargs)
        events.append("eval")  # its generate calls done
        return metrics

    monkeypatch.setattr(FastEngine, "release", spy_release)
    monkeypatch.setattr(FastEngine, "generate", spy_generate)
    monkeypatch.setattr(trainer_module, "evaluate", spy_evaluate)
    Trainer(load_config(None, tiny_overrides(tmp_path, warmup_cache, **{"train.eval_every": 1}))).train()
    evals = [i for i, event in enumerate(events) if event == "eval"]
    assert len(evals) >= 2 and all(events[i + 1] == "release" for i in evals), events


def _graphed_run(tmp_path, warmup_cache, monkeypatch, **extra):
    """A run whose fast engine keeps a decode state between calls on the CPU: buckets, and the decode-step tests'
    stand-in for CUDA graphs (tests/engines/graph_stand_in.py). Returns the overrides and the events:
    ("capture", bucket) per graph captured, ("update",) per update."""
    from podsrl.engines import fast
    from podsrl.engines.decode_step import Buckets
    from podsrl.update import PolicyUpdater
    from tests.engines.graph_stand_in import RecordedGraphs

    events = []

    class CountedGraphs(RecordedGraphs):
        def run(self, key, step):
            if key not in self.graphs:
                events.append(("capture", key))
            return super().run(key, step)

    class GraphedRunner(fast.StepRunner):
        def __init__(self, compile=False, cuda_graphs=False):
            super().__init__(compile, cuda_graphs)
            self.graphs = CountedGraphs()

    update = PolicyUpdater.update

    def spy_update(updater, *args, **kwargs):
        events.append(("update",))
        return update(updater, *args, **kwargs)

    monkeypatch.setattr(fast, "StepRunner", GraphedRunner)
    monkeypatch.setattr(fast, "Buckets", lambda block, exact: Buckets(block=block))
    monkeypatch.setattr(PolicyUpdater, "update", spy_update)
    # no compaction: every step decodes its 16 rows in one bucket, so what a step captures is what it re-captures
    return tiny_overrides(tmp_path, warmup_cache, **{"train.max_steps": 3,
                                                     "rollout.engine_options": "{compaction: false}", **extra}), events


def _captures_per_step(events) -> list[int]:
    """Graphs each step's generation captured (the evals' greedy ones left out)."""
    counts = [0]
    for event in events:
        if event[0] == "update":
            counts.append(0)
        elif not event[1][2].greedy:
            counts[-1] += 1
    return counts[:-1]  # the last entry: after the last update


def test_kept_graphs_are_not_captured_again_after_an_update(tmp_path, warmup_cache, monkeypatch):
    """Where the memory plan fits the engine's decode state beside the update, the trainer keeps it: after the
    first step a step captures nothing, and the kept graphs replay the updated weights (the tokens of an eager
    engine over the trained policy). Before, the trainer released them before every update: one capture a step."""
    from podsrl.engines import SamplingParams
    from podsrl.engines.fast import FastEngine
    from tests.engines.test_engines import random_prompts

    overrides, events = _graphed_run(tmp_path, warmup_cache, monkeypatch)
    trainer = Trainer(load_config(None, overrides))
    trainer.train()
    assert trainer.parts.keep_engine_state
    assert _captures_per_step(events) == [1, 0, 0], events
    prompts, params, seeds = random_prompts([3, 5]), SamplingParams(max_new_tokens=4, temperature=1.0), torch.arange(8)
    eager = FastEngine(trainer.parts.generation_model, trainer.parts.tokenizer, compaction=False)
    replayed = trainer.parts.engine.generate(prompts, [4, 4], params, seeds)
    assert torch.equal(replayed.completion_ids, eager.generate(prompts, [4, 4], params, seeds).completion_ids)


def test_evals_keep_the_training_engines_graphs(tmp_path, warmup_cache, monkeypatch):
    """A synchronous run evaluates with its training engine: 10 steps with an eval every 5 capture the training
    bucket once and each eval's greedy bucket once (the second eval replays it). Before, each eval released the
    engine: the step after it and the next eval captured anew, 5 captures."""
    overrides, events = _graphed_run(tmp_path, warmup_cache, monkeypatch,
                                     **{"train.max_steps": 10, "train.eval_every": 5})
    trainer = Trainer(load_config(None, overrides))
    trainer.train()
    assert trainer.parts.keep_engine_state
    captures = [event[1] for event in events if event[0] == "capture"]
    assert len(captures) == 2 and sum(key[2].greedy for key in captures) == 1, events


def test_decode_state_the_plan_does_not_fit_is_released_before_each_update(tmp_path, warmup_cache, monkeypatch,
                                                                          caplog):
    """On a device too small for the decode state beside the update, the trainer frees it before each update (each
    step captures its graphs anew) and says so in one start-up line."""
    from podsrl.run import engine_state

    overrides, events = _graphed_run(tmp_path, warmup_cache, monkeypatch)
    monkeypatch.setattr(engine_state, "device_memory", lambda device: 2**20)
    with caplog.at_level(logging.INFO, logger="podsrl"):
        trainer = Trainer(load_config(None, overrides))
        trainer.train()
    assert not trainer.parts.keep_engine_state
    assert _captures_per_step(events) == [1, 1, 1], events
    lines = [r.getMessage() for r in caplog.records if "decode state" in r.getMessage()]
    assert len(lines) == 1 and "freed before each update" in lines[0]
