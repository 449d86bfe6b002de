"""Step time of TRL's GRPOTrainer with and without podsrl's PODS down-sampling, side by side in one run.

Three setups on the built-in tiny model, the same prompts per step and the same seed:
  GRPO 16-16   plain TRL GRPOTrainer, 16 completions per prompt, all trained
  GRPO 64-64   plain TRL GRPOTrainer, 64 completions per prompt, all trained
  PODS 64->16  PODSGRPOTrainer, 64 generated per prompt, the 16 with the most reward variance trained

Each setup runs `--warmup` untimed steps then `--steps` timed optimizer steps; with `--rounds 2` the order is
reversed in the second round to cancel drift on a shared machine. Default runtime: about 1 minute on 2 CPU cores.

    python benchmarks/trl_step.py [--prompts 2] [--steps 5] [--max-new-tokens 16] [--rounds 2] [--threads 1]
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
from podsrl.models import build_char_tokenizer, build_tiny_model

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


def run(name: str, n: int, m: int | None, opts, dataset: Dataset) -> tuple[list[float], list[float]]:
    """(step times, generation times) of the timed steps of one setup."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tokenizer, seed=0)
    common = {
        "output_dir": tempfile.mkdtemp(prefix=f"trl_step_{name}_"), "per_device_train_batch_size": opts.prompts * n,
        "num_generations": n, "max_completion_length": opts.max_new_tokens, "max_steps": opts.warmup + opts.steps,
        "learning_rate": 1e-4, "report_to": "none", "bf16": False, "save_strategy": "no", "logging_steps": 10**6,
        "seed": 0, "use_cpu": not torch.cuda.is_available(), "disable_tqdm": True,
    }
    if m is None:
        trainer_cls, config = GRPOTrainer, GRPOConfig(**common)
    else:
        trainer_cls, config = PODSGRPOTrainer, PODSGRPOConfig(**common, pods_m=m, pods_rule="max_variance")
    trainer = trainer_cls(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    timer = StepTimer()
    trainer.add_callback(timer)
    gen_times: list[float] = []
    generate = trainer._generate

    def timed_generate(prompts):
        t0 = time.perf_counter()
        out = generate(prompts)
        gen_times.append(time.perf_counter() - t0)
        return out

    trainer._generate = timed_generate
    trainer.train()
    return timer.times[opts.warmup:], gen_times[opts.warmup:]


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return (f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
            f"{torch.get_num_threads()} torch threads (torch {torch.__version__})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step (same in every setup)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setup and round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    # One thread by default: on a small shared CPU, oversubscribed threads made generation times erratic.
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: torch's default)")
    opts = parser.parse_args()
    if opts.threads and not torch.cuda.is_available():
        torch.set_num_threads(opts.threads)

    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10, 40) for b in range(10, 20)],
                                 "answer": [str(a + b) for a in range(10, 40) for b in range(10, 20)]})
    setups = [("GRPO 16-16", 16, None), ("GRPO 64-64", 64, None), ("PODS 64->16", 64, 16)]
    steps: dict[str, list[float]] = {s[0]: [] for s in setups}
    gens: dict[str, list[float]] = {s[0]: [] for s in setups}
    for r in range(opts.rounds):
        for name, n, m in setups if r % 2 == 0 else setups[::-1]:
            t, g = run(name, n, m, opts, dataset)
            steps[name] += t
            gens[name] += g

    print(f"machine: {machine()}")
    print(f"{opts.prompts} prompts/step, {opts.max_new_tokens} new tokens max, "
          f"{opts.steps} timed steps x {opts.rounds} rounds per setup (after {opts.warmup} warm-up)")
    print(f"{'setup':<12} {'generated':>9} {'trained':>7} {'step s':>8} {'generate s':>10} {'rest s':>8}")
    mean = {k: statistics.mean(v) for k, v in steps.items()}
    for name, n, m in setups:
        g = statistics.mean(gens[name])
        print(f"{name:<12} {opts.prompts * n:>9} {opts.prompts * (m or n):>7} {mean[name]:>8.3f} {g:>10.3f} "
              f"{mean[name] - g:>8.3f}")
    pods, g16, g64 = mean["PODS 64->16"], mean["GRPO 16-16"], mean["GRPO 64-64"]
    print(f"ratio PODS 64->16 / GRPO 16-16 step time: {pods / g16:.2f}")
    print(f"ratio PODS 64->16 / GRPO 64-64 step time: {pods / g64:.2f}")
    print(f"ratio GRPO 64-64 / GRPO 16-16 step time: {g64 / g16:.2f}")


if __name__ == "__main__":
    main()
