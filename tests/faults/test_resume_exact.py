"""Resume is exact for every stateful feature: a run that crashes after a checkpoint and is resumed equals the
straight run (metrics of every record but time/*, and final weights). Each configuration leans on a different piece
of saved state: the data position (dataset epochs), the trainer RNG (selection, mini-batch order), prompt statistics
and the epoch snapshot (DynaMO), AERO's rounds, refills, GRESO's streaks and p_easy / p_hard, Knapsack-RL's ring of
recent outcomes, Reinforce-Ada's rounds, optimiser moments and the LR schedule."""

from __future__ import annotations

import json

import pytest

from podsrl.config import load_config
from podsrl.run.trainer import Trainer
from tests.faults.common import REWARDS, assert_same_run, tiny


def _dataset(tmp_path) -> str:
    # Duplicated questions share a uid, so prompt statistics carry over within an epoch (the snapshot matters).
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(1, 4) for b in range(1, 4)]
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:4]))
    return str(path)


HASHED_CORRECT = f"[{{name: correct, function: '{REWARDS}:spread'}}]"

CONFIGS = {
    "hf_engine_minibatches_cosine": {"rollout.engine": "hf", "optim.epochs": 2, "optim.mini_batches": 2,
                                     "optim.scheduler": "cosine", "optim.warmup_steps": 2},
    "aero": {"method": "aero", "aero.n_explore": 2, "aero.n_extra": 1, "aero.n_max": 4},
    "dynamo_epoch_snapshot_dataset": {
        "task.name": "dataset", "task.args": "{path: DATASET, eval_fraction: 0.2}", "warmup.steps": 0,
        "method": "dynamo", "dynamo.n_min": 2, "dynamo.n_max": 6, "dynamo.min_history": 1,
        "dynamo.refresh": "epoch", "dynamo.modulation": True, "rollout.prompts_per_step": 3},
    # a pool of 6 at 4 prompts a step: epochs end mid-step; allocation history, snapshot and grad/* metrics
    "dynamo_arithmetic_pool_grad_noise": {
        "task.args": "{operands: 2, digits: 1, train_size: 6}", "method": "dynamo",
        "dynamo.modulation": False, "dynamo.n_min": 2, "dynamo.n_max": 6, "dynamo.min_history": 1,
        "dynamo.refresh": "epoch", "log.grad_noise": True},
    "filter_refill_kl": {"filter.zero_variance": True, "filter.max_refill_rounds": 2, "algo.beta": 0.1},
    # The new methods read correctness: a hash of the text stands in for it, so outcomes vary from the first step.
    # A pool of 4: streaks, p_easy / p_hard (adapting from step 2, epoch 1), skips drawing from the sampler, refills
    "greso_pool_refill": {"task.args": "{operands: 2, digits: 1, train_size: 4}", "method": "greso",
                          "filter.zero_variance": True, "filter.max_refill_rounds": 2, "greso.p_init": 0.3,
                          "rewards": HASHED_CORRECT},
    # the ring of recent outcomes and last visits drive unequal allocations; the advantage clip
    "knapsack_pool_clip": {"task.args": "{operands: 2, digits: 1, train_size: 6}", "method": "knapsack",
                           "knapsack.min_history": 4, "knapsack.max_n": 12, "algo.advantage_clip": 1.0,
                           "rewards": HASHED_CORRECT},
    "reinforce_ada_rounds": {"method": "reinforce_ada", "reinforce_ada.round_repeat": 2,
                             "reinforce_ada.max_rounds": 3, "rewards": HASHED_CORRECT},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_crash_and_resume_equals_the_straight_run(tmp_path, warm_cache, monkeypatch, name):
    extra = {k: (v.replace("DATASET", _dataset(tmp_path)) if isinstance(v, str) else v)
             for k, v in CONFIGS[name].items()}
    extra.update({"train.max_steps": 5, "train.save_every": 2, "train.eval_every": 2})

    def config(run):
        return load_config("podsrl/configs/grpo.yaml", tiny(run, warm_cache, **extra))

    Trainer(config(tmp_path / "straight")).train()
    monkeypatch.setenv("PODSRL_FAULTS", "raise@step:4")  # dies in step 4, after the step-2 checkpoint
    with pytest.raises(RuntimeError, match="injected fault"):
        Trainer(config(tmp_path / "crashed")).train()
    monkeypatch.delenv("PODSRL_FAULTS")
    Trainer(config(tmp_path / "crashed"), resume=True).train()
    assert_same_run(tmp_path / "crashed", tmp_path / "straight")
