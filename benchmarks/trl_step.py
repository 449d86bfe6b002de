"""Step time of TRL's GRPOTrainer with and without podsrl's PODS down-sampling, side by side in one run.

Three setups on the built-in tiny model, the same prompts per step and the same seed:
  GRPO 16-16   plain TRL GRPOTrainer, 16 completions per prompt, all trained
  GRPO 64-64   plain TRL GRPOTrainer, 64 completions per prompt, all trained
  PODS 64->16  PODSGRPOTrainer, 64 generated per prompt, the 16 with the most reward variance trained

Arms are interleaved in rounds (`--rounds`, default 5): each round runs every setup for `--warmup` untimed then
`--steps` timed optimizer steps, in an order rotated from round to round to cancel drift on a shared machine. Prints
per setup the median over rounds of the round's mean step time with its min-max spread, and the median (min-max) of
the per-round ratios. Default runtime: about 3 minutes on 2 idle CPU cores.

    python benchmarks/trl_step.py [--prompts 2] [--steps 2] [--max-new-tokens 16] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import warnings

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from podsrl.config import TinyModelConfig
from podsrl.integrations.trl import PODSGRPOConfig, PODSGRPOTrainer
from podsrl.models.loading import build_char_tokenizer, build_tiny_model

warnings.filterwarnings("ignore", category=FutureWarning)


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step (generation, scoring, selection, loss, backward and optimizer)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t0)


def reward(prompts, completions, answer, **kwargs) -> list[float]:
    # Continuous and cheap: partial credit per right digit plus a small term for digits at all.
    return [sum(a == b for a, b in zip(c, t)) / len(t) + 0.1 * sum(ch.isdigit() for ch in c) / max(len(c), 1)
            for c, t in zip(completions, answer)]


def build_trainer(name: str, n: int, m: int | None, opts, dataset: Dataset, model=None, tokenizer=None,
                  reward_funcs=reward):
    """A TRL trainer for one setup (GRPOTrainer, or PODSGRPOTrainer when m is given) and the list its generation
    times are appended to; by default on the built-in tiny model (`opts.model_config`) and this file's reward."""
    if model is None:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(getattr(opts, "model_config", None) or TinyModelConfig(), tokenizer, seed=0)
    common = {
        "output_dir": tempfile.mkdtemp(prefix=f"trl_step_{name}_"), "per_device_train_batch_size": opts.prompts * n,
        "num_generations": n, "max_completion_length": opts.max_new_tokens, "max_steps": opts.warmup + opts.steps,
        "learning_rate": 1e-4, "report_to": "none", "save_strategy": "no", "logging_steps": 10**6,
        "seed": 0, "use_cpu": not torch.cuda.is_available(), "disable_tqdm": True,
    }
    if not torch.cuda.is_available():  # float32 on the CPU, as podsrl computes there; on CUDA TRL's bf16 default
        common["bf16"] = False
    if getattr(opts, "trl_no_checkpointing", False):  # TRL's GRPOConfig turns it on by default
        common["gradient_checkpointing"] = False
    if m is None:
        trainer_cls, config = GRPOTrainer, GRPOConfig(**common)
    else:
        trainer_cls, config = PODSGRPOTrainer, PODSGRPOConfig(**common, pods_m=m, pods_rule="max_variance")
    trainer = trainer_cls(model=model, reward_funcs=reward_funcs, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    gen_times: list[float] = []
    generate = trainer._generate

    def timed_generate(prompts):
        t0 = time.perf_counter()
        out = generate(prompts)
        gen_times.append(time.perf_counter() - t0)
        return out

    trainer._generate = timed_generate
    return trainer, gen_times


def run(name: str, n: int, m: int | None, opts, dataset: Dataset) -> tuple[list[float], list[float]]:
    """(step times, generation times) of the timed steps of one setup."""
    trainer, gen_times = build_trainer(name, n, m, opts, dataset)
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    return timer.times[opts.warmup:], gen_times[opts.warmup:]


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    load = os.getloadavg()
    return (f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
            f"{torch.get_num_threads()} torch threads (torch {torch.__version__}), "
            f"load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step (same in every setup)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setup and round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    # One thread by default: on a small shared CPU, oversubscribed threads made generation times erratic.
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: torch's default)")
    opts = parser.parse_args()
    if opts.threads and not torch.cuda.is_available():
        torch.set_num_threads(opts.threads)

    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10, 40) for b in range(10, 20)],
                                 "answer": [str(a + b) for a in range(10, 40) for b in range(10, 20)]})
    setups = [("GRPO 16-16", 16, None), ("GRPO 64-64", 64, None), ("PODS 64->16", 64, 16)]
    steps: dict[str, list[float]] = {s[0]: [] for s in setups}  # per round: mean of its timed steps
    gens: dict[str, list[float]] = {s[0]: [] for s in setups}
    for r in range(opts.rounds):
        for name, n, m in setups[r % len(setups):] + setups[:r % len(setups)]:
            t, g = run(name, n, m, opts, dataset)
            steps[name].append(statistics.mean(t))
            gens[name].append(statistics.mean(g))

    print(f"machine: {machine()}")
    print(f"{opts.prompts} prompts/step, {opts.max_new_tokens} new tokens max, {opts.rounds} rounds x "
          f"{opts.steps} timed steps per setup (after {opts.warmup} warm-up); median over rounds (min-max)")
    print(f"{'setup':<12} {'generated':>9} {'trained':>7} {'step s':>22} {'generate s':>10} {'rest s':>8}")
    for name, n, m in setups:
        st, g = steps[name], statistics.median(gens[name])
        print(f"{name:<12} {opts.prompts * n:>9} {opts.prompts * (m or n):>7} "
              f"{f'{statistics.median(st):.3f} ({min(st):.3f}-{max(st):.3f})':>22} {g:>10.3f} "
              f"{statistics.median(st) - g:>8.3f}")

    def ratio(a: str, b: str) -> str:
        r = [x / y for x, y in zip(steps[a], steps[b])]
        return f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"

    print(f"ratio PODS 64->16 / GRPO 16-16 step time: {ratio('PODS 64->16', 'GRPO 16-16')}")
    print(f"ratio PODS 64->16 / GRPO 64-64 step time: {ratio('PODS 64->16', 'GRPO 64-64')}")
    print(f"ratio GRPO 64-64 / GRPO 16-16 step time: {ratio('GRPO 64-64', 'GRPO 16-16')}")


if __name__ == "__main__":
    main()
