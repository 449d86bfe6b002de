"""The background generator's schedule (podsrl/run/async_generation.py) with a stand-in for the trainer: a one-weight
model whose value is the number of updates it has had, and a produce that reads it. Random sleeps on both sides
stand for every interleaving the timing can give; the trained sequence must be the same for all of them."""

from __future__ import annotations

import random
import time

import pytest
import torch

from podsrl.batch import Problem, RolloutBatch
from podsrl.engines.base import RolloutEngine
from podsrl.run.async_generation import BackgroundGenerator
from podsrl.run.producer import ProducedBatch

STEPS = 9


class SyncOnly(RolloutEngine):
    """An engine of which the generator uses only the weight sync (produce samples nothing here)."""

    def __init__(self) -> None:
        self.synced: list[float] = []

    def generate(self, prompts, counts, params, seeds):
        raise AssertionError("not used")

    def sync_weights(self, model) -> None:
        self.synced.append(float(model.weight.detach()))


def one_row_batch(step: int) -> RolloutBatch:
    return RolloutBatch(problems=[Problem(uid=f"p{step}", prompt="1+1=", answer="2", metadata={"row": step})],
                        group_index=torch.zeros(1, dtype=torch.long), prompt_ids=torch.ones(1, 2, dtype=torch.long),
                        prompt_mask=torch.ones(1, 2, dtype=torch.long), completion_ids=torch.ones(1, 3, dtype=torch.long),
                        completion_mask=torch.ones(1, 3), truncated=torch.zeros(1, dtype=torch.bool),
                        rewards=torch.tensor([float(step)]), advantages=torch.tensor([0.5]))


def updates_model() -> torch.nn.Linear:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    return model


def run_schedule(staleness: int, timing_seed: int, start: int = 0, in_flight=(), steps: int = STEPS):
    """Trains steps start..steps-1 against a generator with random sleeps on both sides; returns per trained step
    (step, version, the weights produce saw, rows' policy_version, how far the generator ran ahead) and the
    generator."""
    learner, generator_model = updates_model(), updates_model()
    with torch.no_grad():
        learner.weight.fill_(float(start))
        generator_model.weight.fill_(float(start))
    generator_sleeps, learner_sleeps = random.Random(timing_seed), random.Random(timing_seed + 1)
    learner_step = [start]

    def produce(step: int) -> ProducedBatch:
        ahead = step - learner_step[0]  # read before sampling, like the real collect would
        time.sleep(generator_sleeps.uniform(0, 0.004))
        seen = float(generator_model.weight.detach())
        return ProducedBatch(kept=one_row_batch(step), metrics={"seen": seen, "ahead": float(ahead)},
                             generated_rollouts=1, generated_tokens=3)

    generator = BackgroundGenerator(produce, generator_model, SyncOnly(), staleness, start, steps, list(in_flight))
    trained = []
    try:
        for step in range(start, steps):
            learner_step[0] = step
            generator.publish(step, learner)
            batch, _ = generator.take(step)
            time.sleep(learner_sleeps.uniform(0, 0.004))
            with torch.no_grad():
                learner.weight.add_(1.0)  # the update: w_{step+1}
            trained.append((step, batch.version, batch.metrics.get("seen"), batch.kept.policy_version.tolist(),
                            batch.metrics.get("ahead")))
    finally:
        generator.close()
    return trained, generator


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_fixed_lag_whatever_the_timing(staleness):
    runs = [run_schedule(staleness, seed)[0] for seed in range(6)]
    for trained in runs:
        for step, version, seen, rows, ahead in trained:
            assert version == max(0, step - staleness)  # the lag, hence staleness <= the bound
            assert seen == version  # produced from exactly those weights, loaded before sampling
            assert rows == [version]
            assert 0 <= ahead <= staleness  # never further ahead than the weights it needs allow
    # the trained sequence does not depend on timing (how far ahead the generator happened to be does)
    assert all([t[:4] for t in run] == [t[:4] for t in runs[0]] for run in runs[1:])


def test_staleness_zero_takes_turns():
    trained, generator = run_schedule(0, timing_seed=3)
    assert [t[4] for t in trained] == [0.0] * STEPS  # each batch produced while the learner waited for it
    assert generator.engine.synced == [float(k) for k in range(1, STEPS)]  # one weight sync per update


def test_quiesce_returns_the_in_flight_batches_and_holds_the_generator():
    learner, generator_model = updates_model(), updates_model()
    produced_steps = []

    def produce(step):
        produced_steps.append(step)
        return ProducedBatch(kept=one_row_batch(step), metrics={}, generated_rollouts=1, generated_tokens=3)

    generator = BackgroundGenerator(produce, generator_model, SyncOnly(), 2, 0, STEPS)
    try:
        generator.publish(0, learner)
        generator.take(0)
        in_flight = generator.quiesce()  # w_1 not published: batches 1 and 2 (under w_0), nothing more
        assert [b.kept.problems[0].uid for b in in_flight] == ["p1", "p2"] and produced_steps == [0, 1, 2]
        time.sleep(0.05)
        assert produced_steps == [0, 1, 2]
    finally:
        generator.close()


def test_resume_from_saved_batches_continues_the_same_sequence():
    straight, _ = run_schedule(2, timing_seed=0)
    # The state a checkpoint after step 4 holds: batches 4 and 5, produced under w_2 and w_3.
    saved = [ProducedBatch.from_state(_saved(step, version)) for step, version in ((4, 2), (5, 3))]
    resumed, generator = run_schedule(2, timing_seed=1, start=4, in_flight=saved)
    assert generator.dropped == 0
    assert [t[:2] for t in resumed] == [t[:2] for t in straight[4:]]


def test_a_lower_bound_at_resume_drops_what_would_train_too_late():
    saved = [ProducedBatch.from_state(_saved(step, version)) for step, version in ((4, 2), (5, 3))]
    resumed, generator = run_schedule(1, timing_seed=0, start=4, in_flight=saved)
    # batch of step 4 (w_2) would train 2 steps late: dropped; the next (w_3) then trains at step 4, 1 late: kept
    assert generator.dropped == 1
    assert [t[:2] for t in resumed] == [(4, 3), (5, 4), (6, 5), (7, 6), (8, 7)]


def _saved(step: int, version: int) -> dict:
    batch = ProducedBatch(kept=one_row_batch(step), metrics={"seen": float(version)}, generated_rollouts=1,
                          generated_tokens=3, version=version)
    batch.kept.policy_version = torch.tensor([version])
    state = batch.state_dict()
    # what torch.load(weights_only=True) gives back: checks the state holds nothing else
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_failure_in_the_generator_reaches_the_learner():
    def produce(step):
        if step == 2:
            raise ValueError("reward function broke")
        return ProducedBatch(kept=one_row_batch(step), metrics={}, generated_rollouts=1, generated_tokens=3)

    generator = BackgroundGenerator(produce, updates_model(), SyncOnly(), 1, 0, STEPS)
    learner = updates_model()
    try:
        generator.publish(0, learner)
        generator.take(0)
        generator.publish(1, learner)
        with pytest.raises(ValueError, match="reward function broke"):
            generator.take(1)  # batch 1 is there, but 2 failed meanwhile or right after: either way it surfaces
            generator.publish(2, learner)
            generator.take(2)
    finally:
        generator.close()


def test_saved_batch_round_trips():
    state = _saved(3, 1)
    batch = ProducedBatch.from_state(state)
    assert batch.version == 1 and batch.kept.problems[0] == one_row_batch(3).problems[0]
    assert torch.equal(batch.kept.rewards, torch.tensor([3.0])) and batch.kept.policy_version.tolist() == [1]


def test_the_config_key_is_train_async(tmp_path):
    from podsrl.config import ConfigError, config_help, dump_config, load_config

    cfg = load_config(None, ["train.async.enabled=true", "train.async.max_staleness=2"])
    assert cfg.train.asynchronous.enabled and cfg.train.asynchronous.max_staleness == 2
    dump_config(cfg, tmp_path / "config.yaml")  # what a resume reads back
    assert load_config(tmp_path / "config.yaml").train.asynchronous == cfg.train.asynchronous
    assert "train.async.max_staleness" in {key for key, _, _ in config_help()}
    with pytest.raises(ConfigError, match="train.asynchronous: unknown config key"):
        load_config(None, ["train.asynchronous.enabled=true"])
    with pytest.raises(ConfigError, match="train.async.enabled: needs rollout.engine fast or ray"):
        load_config(None, ["train.async.enabled=true", "rollout.engine=hf"])
    with pytest.raises(ConfigError, match="train.async.max_staleness: must be >= 0"):
        load_config(None, ["train.async.max_staleness=-1"])
