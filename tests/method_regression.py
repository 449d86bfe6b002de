"""Per-step metrics of the first steps of each method preset at a fixed seed: the regression fixture.

    PYTHONPATH=$PWD python -m tests.method_regression   # re-record tests/fixtures/method_regression.json

The runs are tiny (2 prompts a step, 4-token completions, a 2-layer model after a short warm-up) and skip eval;
they start from the warmed-up weights stored in tests/fixtures/method_regression_start.safetensors, not from a
warm-up run here: 150 supervised steps amplify the CPU's float summation order into different weights (another
CPU's warm-up diverged by a sampled token within three RL steps), while three RL steps from equal weights do not.
Re-recording keeps the stored weights; delete the file to record new ones from this machine's warm-up. The fixture
names the machine it was recorded on (under RECORDED_ON), and records with one torch thread, as the test runs.
the preset's own method keys and rollout.n stay as they are, plus a few cases with extra keys (the generic filter
and refill, DynaMO's allocation alone with the gradient-noise probe, several update passes, AERO's dead zone, PODS
ties, DynaMO's mastered rule). Timings (time/*) are
not recorded.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from podsrl.config import load_config
from podsrl.models.loading import build_char_tokenizer, build_tiny_model
from podsrl.run.trainer import Trainer
from podsrl.run.warmup import run_warmup, warmup_path

PRESETS = ["grpo", "pods", "pods_random", "pods_max_reward", "aero", "dynamo", "dynamo_pool"]
# case -> (preset, extra overrides); the extra cases were recorded with the code before the redesign under its keys
# (select.filter_zero_variance / select.max_refill_rounds, algo.modulation=none)
CASES: dict[str, tuple[str, dict]] = {
    **{p: (p, {}) for p in PRESETS},
    # correctness alone and 4 rollouts a prompt: many groups are all-wrong or all-right, so the filter refills
    "grpo_filter_refill": ("grpo", {"filter.zero_variance": True, "filter.max_refill_rounds": 2,
                                    "rewards": "[correct]", "rollout.n": 4}),
    "dynamo_allocation_grad_noise": ("dynamo_pool", {"dynamo.modulation": False, "log.grad_noise": True}),
    "grpo_two_passes_two_mini_batches": ("grpo", {"optim.epochs": 2, "optim.mini_batches": 2}),
    # 2 rollouts a prompt and no rescue: groups stay all-fail or all-success, so the posterior advantage trains
    "aero_dead_zone": ("aero", {"aero.n_explore": 2, "aero.n_max": 2, "aero.keep_dead": 2}),
    # binary rewards: many 4-subsets of 8 share the largest variance, so the tie rule picks the kept rows
    "pods_ties": ("pods", {"rewards": "[correct]", "rollout.n": 8, "pods.m": 4}),
    # revisited prompts at or above a success rate of 0.2 count as mastered and get the floor priority
    "dynamo_mastered": ("dynamo_pool", {"dynamo.mastered_rate": 0.2}),
    # the later methods on the pool of 4 (GRESO: correctness alone, so streaks form and the filter refills)
    "greso": ("greso", {"rewards": "[correct]", "rollout.n": 4}),
    "knapsack": ("knapsack", {}),
    "reinforce_ada": ("reinforce_ada", {}),
}
STEPS = 3
# Correctness plus a graded reward, so that groups have reward variance and every selection rule has work to do.
REWARDS = f"[correct, {{name: digits, weight: 0.5, function: '{Path(__file__).parent / 'fixtures' / 'rewards_ones.py'}:even_digit_share'}}]"
FIXTURE = Path(__file__).parent / "fixtures" / "method_regression.json"
RECORDED_ON = "_recorded_on"  # the fixture's entry naming the machine, beside the cases
START_WEIGHTS = Path(__file__).parent / "fixtures" / "method_regression_start.safetensors"
TIED = "lm_head.weight"  # the built-in model ties it to the embedding: stored once


def overrides(run_dir: str, warmup_cache: str, preset: str, extra: dict | None = None) -> list[str]:
    # A pool of 4 problems at 2 a step, so step 3 revisits prompts and decides from their history.
    pooled = preset in ("dynamo_pool", "greso", "knapsack")
    task_args = "{operands: 2, digits: 1, train_size: 4}" if pooled else "{operands: 2, digits: 1}"
    values = {
        "output_dir": run_dir, "seed": 3, "warmup.cache_dir": warmup_cache, "warmup.steps": 150,
        "warmup.target_accuracy": 0.3, "warmup.check_every": 25, "warmup.validation_size": 64,
        "warmup.batch_size": 32, "rewards": REWARDS, "model.tiny.num_layers": 2,
        "model.tiny.hidden_size": 64, "model.tiny.intermediate_size": 128, "task.eval_size": 4,
        "task.args": task_args, "eval.samples": 0, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 4,
        "train.max_steps": STEPS, "log.progress": False, "log.tensorboard": False, "log.plot": False,
        # The plain update path recorded the fixture; the shared-prompt path equals it only to float rounding
        # (tests/update/test_shared_prompt.py), which a 1e-6 comparison over three steps would flag.
        "update.shared_prompt": False,
    }
    if preset == "dynamo_pool":  # the split-half probe changes a modulated update, so DynaMO refuses it
        values["log.grad_noise"] = False
    values.update(extra or {})
    return [f"{k}={v}" for k, v in values.items()]


def run_case(case: str, run_dir: str, warmup_cache: str) -> list[dict]:
    """Metrics of the first STEPS steps (no eval), without time/* keys."""
    preset, extra = CASES[case]
    cfg = load_config(Path(__file__).parents[1] / "podsrl" / "configs" / f"{preset}.yaml",
                      overrides(run_dir, warmup_cache, preset, extra))
    place_start_weights(cfg)
    trainer = Trainer(cfg)
    try:
        records = [trainer.train_step().metrics for _ in range(STEPS)]
    finally:
        trainer.parts.engine.close()
        trainer.logger.close()
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def place_start_weights(cfg) -> None:
    """Puts the stored warmed-up weights where the trainer looks for this config's warm-up (a cache hit), or, when
    none are stored, runs the warm-up and stores its weights."""
    out = warmup_path(cfg)
    if (out / "config.json").is_file():
        return
    if not START_WEIGHTS.is_file():
        run_warmup(cfg, progress=False)
        weights = AutoModelForCausalLM.from_pretrained(out).state_dict()
        save_file({k: v for k, v in weights.items() if k != TIED}, START_WEIGHTS)
        return
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg.model.tiny, tokenizer)
    missing, unexpected = model.load_state_dict(load_file(START_WEIGHTS), strict=False)
    assert set(missing) <= {TIED} and not unexpected, (missing, unexpected)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "warmup.json").write_text(json.dumps({"source": START_WEIGHTS.name}))


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() \
        else platform.processor()
    return {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat()}


def main() -> int:
    torch.set_num_threads(1)  # as the test runs (its one_thread fixture)
    with tempfile.TemporaryDirectory() as tmp:
        fixture = {c: run_case(c, f"{tmp}/{c}", f"{tmp}/warmup") for c in CASES}
    fixture[RECORDED_ON] = machine()
    FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
