"""train.async is exact: max_staleness 0 is the synchronous run bit for bit; with a lag the run is the same whatever
the timing of generator and learner, resumes exactly after a crash or a SIGKILL (the checkpoint carries the batches
generated ahead), and a resume with a lower bound drops the batches that would train too late, counted. Per-prompt
history sees every trained batch once; the rollout correction weighs a stale batch against the learner's weights."""

from __future__ import annotations

import random
import signal
import time

import pytest
import torch

from podsrl.config import load_config
from podsrl.errors import UserError
from podsrl.run.producer import BatchProducer
from podsrl.run.trainer import Trainer
from podsrl.update import PolicyUpdater
from podsrl.update.plain import plain_logprobs
from tests.faults.common import (
    MAX_STEPS,
    REWARDS,
    assert_same_run,
    final_weights,
    last_step,
    records,
    resume_argv,
    tiny,
    train_argv,
    wait_for_step,
)

HASHED_CORRECT = f"[{{name: correct, function: '{REWARDS}:spread'}}]"
# per-prompt history (streaks) read by collect, p_easy / p_hard moved by end_step, refills drawn by the generator
GRESO_REFILL = {"task.args": "{operands: 2, digits: 1, train_size: 4}", "method": "greso",
                "filter.zero_variance": True, "filter.max_refill_rounds": 2, "greso.p_init": 0.3,
                "rewards": HASHED_CORRECT}


def config(run, cache, staleness=None, **extra):
    if staleness is not None:  # the generator on one thread, like the learner (the fixture's torch setting)
        extra.update({"train.async.enabled": True, "train.async.max_staleness": staleness,
                      "train.async.generator_threads": 1})
    return load_config("podsrl/configs/grpo.yaml", tiny(run, cache, **extra))


@pytest.fixture
def random_timing(monkeypatch):
    """Random sleeps in every generate call (generator thread) and every update (learner), seeded per call of
    the returned function."""

    def apply(seed: int) -> None:
        generator_sleeps, learner_sleeps = random.Random(seed), random.Random(seed + 1)
        generate, update = BatchProducer.generate_and_score, PolicyUpdater.update

        def slow_generate(self, *args, **kwargs):
            time.sleep(generator_sleeps.uniform(0, 0.03))
            return generate(self, *args, **kwargs)

        def slow_update(self, *args, **kwargs):
            time.sleep(learner_sleeps.uniform(0, 0.03))
            return update(self, *args, **kwargs)

        monkeypatch.setattr(BatchProducer, "generate_and_score", slow_generate)
        monkeypatch.setattr(PolicyUpdater, "update", slow_update)

    return apply


@pytest.mark.parametrize("name", ["pods", "greso_refill", "bf16_compute"])
def test_staleness_zero_is_the_synchronous_run(tmp_path, warm_cache, name):
    """Every record, evals included: with bf16 compute the engines sample from their own bf16 copies, the eval
    engine's (of the learner's weights) refreshed before each eval as the synchronous engine's is after each step."""
    extra = {"greso_refill": GRESO_REFILL, "bf16_compute": {"model.compute_dtype": "bfloat16"}}.get(name, {})
    Trainer(config(tmp_path / "sync", warm_cache, **extra)).train()
    Trainer(config(tmp_path / "async", warm_cache, staleness=0, **extra)).train()
    got, want = records(tmp_path / "async"), records(tmp_path / "sync")
    for record in got:
        if "reward" in record:  # the async run adds its own keys; staleness 0 on every step
            assert record.pop("async/staleness_max") == record.pop("async/staleness_mean") == 0.0
            assert record.pop("async/dropped_batches") == 0.0
    assert got == want
    a, b = final_weights(tmp_path / "async"), final_weights(tmp_path / "sync")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_lagged_run_does_not_depend_on_timing(tmp_path, warm_cache, random_timing):
    for seed in (1, 2):
        random_timing(seed)
        Trainer(config(tmp_path / f"timing-{seed}", warm_cache, staleness=2, **GRESO_REFILL)).train()
    assert_same_run(tmp_path / "timing-2", tmp_path / "timing-1")
    steps = [r for r in records(tmp_path / "timing-1") if "reward" in r]
    # step k (1-based) trains the batch sampled under the weights of step max(0, k - 1 - 2)
    assert [r["async/staleness_max"] for r in steps] == [min(r["step"] - 1, 2) for r in steps]
    assert all(r["sampling/importance_sampling_ratio/mean"] > 0 for r in steps)  # the correction is on (auto)


def test_evals_wait_for_the_batch_being_generated(tmp_path, warm_cache, monkeypatch):
    # a slow generator: without the wait it would still be sampling step k+1's batch when step k's eval starts
    generate = BatchProducer.generate_and_score
    monkeypatch.setattr(BatchProducer, "generate_and_score", lambda self, *a: time.sleep(0.2) or generate(self, *a))
    idle_at_eval = []
    run_eval = Trainer.run_eval
    monkeypatch.setattr(Trainer, "run_eval", lambda self: idle_at_eval.append(self.generator.idle) or run_eval(self))
    Trainer(config(tmp_path / "run", warm_cache, 1, **{"train.eval_every": 2, "train.max_steps": 4})).train()
    assert idle_at_eval == [True] * 3  # steps 0, 2 and 4


def test_prompt_history_sees_each_trained_batch_once(tmp_path, warm_cache):
    trainer = Trainer(config(tmp_path / "run", warm_cache, staleness=1, **GRESO_REFILL))
    trainer.train()
    # every rollout generated for a trained step recorded once; nothing generated beyond the last step
    generated = trainer.parts.accountant.totals["rollouts_generated"]
    assert sum(trainer.parts.producer.stats.state_dict()["attempts"]) == generated


RESUMED = {
    "pods_lag1": (1, {}),
    "greso_refill_lag2": (2, GRESO_REFILL),
    "reinforce_ada_rounds_lag1": (1, {"method": "reinforce_ada", "reinforce_ada.round_repeat": 2,
                                      "reinforce_ada.max_rounds": 3, "rewards": HASHED_CORRECT}),
    "aero_lag1_minibatches": (1, {"method": "aero", "aero.n_explore": 2, "aero.n_extra": 1, "aero.n_max": 4,
                                  "optim.epochs": 2, "optim.mini_batches": 2}),
    # allocation from history, the epoch snapshot taken by the generator, modulation in the learner
    "dynamo_epoch_snapshot_lag1": (1, {"task.args": "{operands: 2, digits: 1, train_size: 6}", "method": "dynamo",
                                       "dynamo.n_min": 2, "dynamo.n_max": 6, "dynamo.min_history": 1,
                                       "dynamo.refresh": "epoch", "rewards": HASHED_CORRECT}),
    "knapsack_lag2": (2, {"task.args": "{operands: 2, digits: 1, train_size: 6}", "method": "knapsack",
                          "knapsack.min_history": 4, "knapsack.max_n": 12, "rewards": HASHED_CORRECT}),
}


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_crash_and_resume_equals_the_straight_async_run(tmp_path, warm_cache, monkeypatch, name):
    staleness, extra = RESUMED[name]
    Trainer(config(tmp_path / "straight", warm_cache, staleness, **extra)).train()
    monkeypatch.setenv("PODSRL_FAULTS", "raise@step:4")  # dies in step 4, after the step-2 checkpoint
    with pytest.raises(RuntimeError, match="injected fault"):
        Trainer(config(tmp_path / "crashed", warm_cache, staleness, **extra)).train()
    monkeypatch.delenv("PODSRL_FAULTS")
    Trainer(config(tmp_path / "crashed", warm_cache, staleness, **extra), resume=True).train()
    assert_same_run(tmp_path / "crashed", tmp_path / "straight")


def test_a_lower_bound_at_resume_drops_and_counts(tmp_path, warm_cache, monkeypatch):
    monkeypatch.setenv("PODSRL_FAULTS", "raise@step:4")
    with pytest.raises(RuntimeError, match="injected fault"):
        Trainer(config(tmp_path / "run", warm_cache, 2)).train()
    monkeypatch.delenv("PODSRL_FAULTS")
    # The step-2 checkpoint holds the batches of steps 3 and 4 (1-based), sampled under w_0 and w_1. With bound 1
    # the first would train 2 steps late: dropped; the second trains at step 3, 1 step late.
    Trainer(config(tmp_path / "run", warm_cache, 1), resume=True).train()
    steps = {r["step"]: r for r in records(tmp_path / "run") if "reward" in r}
    assert [steps[k]["async/dropped_batches"] for k in range(1, MAX_STEPS + 1)] == [0, 0, 1, 1, 1, 1]
    assert max(steps[k]["async/staleness_max"] for k in range(3, MAX_STEPS + 1)) == 1


def test_a_synchronous_resume_of_an_async_checkpoint_is_refused(tmp_path, warm_cache, monkeypatch):
    monkeypatch.setenv("PODSRL_FAULTS", "raise@step:4")
    with pytest.raises(RuntimeError, match="injected fault"):
        Trainer(config(tmp_path / "run", warm_cache, 1)).train()
    monkeypatch.delenv("PODSRL_FAULTS")
    with pytest.raises(UserError, match="train.async.enabled=true"):  # the step-2 checkpoint holds step 3's batch
        Trainer(config(tmp_path / "run", warm_cache), resume=True)


def test_the_correction_weighs_a_stale_batch_against_the_learners_weights(tmp_path, warm_cache):
    cfg = config(tmp_path / "run", warm_cache, 1, **{"algo.rollout_correction": "sequence_tis",
                                                      "algo.rollout_correction_cap": 1.001})
    trainer = Trainer(cfg)
    sampler_weights = {k: v.clone() for k, v in trainer.parts.model.state_dict().items()}  # w_0
    trainer.train_step()  # step 0 trains the batch of w_0; the learner now holds w_1
    trainer.generator.publish(1, trainer.parts.model)
    produced, _ = trainer.generator.take(1)  # step 1's batch: sampled under w_0, one step stale
    assert produced.version == 0 and produced.kept.policy_version.unique().tolist() == [0]
    batch = produced.kept.trim_padding()
    rows, width = torch.arange(batch.num_rollouts), batch.completion_mask.shape[1]

    def logprobs(model):
        with torch.no_grad():
            return plain_logprobs(model, batch, rows, width, trainer.dist.device, cfg.rollout.temperature, 1024)[0]

    learner_weights = {k: v.clone() for k, v in trainer.parts.model.state_dict().items()}
    learner = logprobs(trainer.parts.model)
    trainer.parts.model.load_state_dict(sampler_weights)
    assert torch.allclose(logprobs(trainer.parts.model), batch.sampler_logprobs, atol=1e-4)  # the sampler was w_0
    trainer.parts.model.load_state_dict(learner_weights)
    # by hand: rho = exp(sum over the sequence of learner - sampler log-probs), truncated to [0, cap]
    cap = cfg.algo.rollout_correction_cap
    rho = torch.exp(((learner - batch.sampler_logprobs) * batch.completion_mask).sum(dim=1))
    metrics = trainer.parts.updater.update(batch, trainer.parts.update_rng)
    trainer.close_engines()
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(rho.clamp(max=cap).mean()),
                                                                               abs=1e-5)
    assert metrics["sampling/importance_sampling_ratio/clipped_fraction"] == float((rho > cap).float().mean())
    assert float(rho.min()) < 0.999  # one step of updates moved the probabilities: the case is not trivial


def test_sigkill_at_random_times_resumes_the_async_run(tmp_path, launcher, warm_cache):
    extra = {"train.async.enabled": True, "train.async.max_staleness": 1}
    reference = tmp_path / "reference"
    assert launcher.run(train_argv(reference, warm_cache, **extra)).code == 0
    run, rng, kills = tmp_path / "run", random.Random(34), 0
    while kills < 3:
        fresh = not (run / "config.yaml").is_file()
        child = launcher.start(train_argv(run, warm_cache, **extra) if fresh else resume_argv(run),
                               env={"SPREAD_SLEEP": "0.1"})
        wait_for_step(run, min(MAX_STEPS - 1, last_step(run) + rng.randint(1, 3)), child)
        time.sleep(rng.uniform(0.0, 0.08))
        child.signal(signal.SIGKILL)
        if child.wait().code == 0:
            break
        kills += 1
    if not (run / "summary.json").exists():
        assert launcher.run(resume_argv(run)).code == 0
    assert_same_run(run, reference)


def test_the_ray_pool_generates_ahead_like_the_in_process_generator(tmp_path, warm_cache):
    # Without a correction the sampler's log-probs play no part, and the pool returns the in-process engine's tokens
    # for the same weights and seeds: the runs are equal only if every actor got each version before sampling.
    extra = {"algo.rollout_correction": "none", "train.max_steps": 4}
    Trainer(config(tmp_path / "fast", warm_cache, 1, **extra)).train()
    Trainer(config(tmp_path / "ray", warm_cache, 1, **extra, **{
        "rollout.engine": "ray", "rollout.engine_options": "{num_workers: 2, num_cpus: 2}"})).train()
    assert_same_run(tmp_path / "ray", tmp_path / "fast")


@pytest.mark.parametrize("compute", ["bfloat16", "float32"])
def test_the_generator_keeps_one_copy_in_the_dtype_it_samples_in(tmp_path, warm_cache, compute):
    """bf16 compute over float32 masters: the generator's copy is in bfloat16 and its engine samples from it (no
    float32 copy beside the engine's); either way the copy's projections are the decode step's fused weights."""
    trainer = Trainer(config(tmp_path / "run", warm_cache, 1, **{"model.compute_dtype": compute,
                                                                 "train.max_steps": 2}))
    trainer.train()
    assert {p.dtype for p in trainer.parts.generator_model.parameters()} == {getattr(torch, compute)}
    assert {p.dtype for p in trainer.parts.model.parameters()} == {torch.float32}
    assert trainer.parts.engine.copy is None and trainer.parts.engine.model is trainer.parts.generator_model
    for plan, layer in zip(trainer.parts.engine.forward.plans, trainer.parts.engine.forward.layers, strict=True):
        assert plan.qkv[0].data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
        assert plan.gate_up.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
