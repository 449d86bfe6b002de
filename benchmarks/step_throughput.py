"""Throughput of a full RL step: podsrl vs TRL's GRPOTrainer, and PODS 64->16 vs GRPO 16-16 through the trainer.

Part 1 (same model, tokenizer, batch, n = 16, completion length, beta = 0, one process): for 64 and 256 rollouts per
step, podsrl's generation rollouts/s and tokens/s, update rollouts/s and tokens/s, and full step time, beside TRL's
GRPOTrainer step on the same setup; prints podsrl/TRL throughput ratios (target: >= 1.5x on the full step).
The tiny model is untrained here, so completions run to the full length in both frameworks.

Part 2 (the built-in task with the warmed-up model, as `podsrl train` runs it): mean step time of PODS 64->16 vs
GRPO 16-16 with the default engine, and its split into generate/score/select/update (target: ratio <= 1.3).

    python benchmarks/step_throughput.py [--steps 4] [--threads 1] [--skip-trl] [--skip-task]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from podsrl.config import load_config  # noqa: E402
from podsrl.trainer import Trainer  # noqa: E402

STEP_KEYS = ("time/generate", "time/score", "time/select", "time/update", "time/step", "tokens/generated",
             "tokens/trained", "rollouts/generated", "rollouts/trained")


def podsrl_steps(overrides: list[str], steps: int, warmup: int = 1) -> dict:
    """Mean per-step metrics of `steps` timed train steps (after `warmup` untimed ones)."""
    out_dir = tempfile.mkdtemp(prefix="podsrl_step_")
    trainer = Trainer(load_config(None, [f"output_dir={out_dir}", "log.progress=false", "log.tensorboard=false",
                                         "log.plot=false", *overrides]))
    records = []
    for i in range(warmup + steps):
        metrics = trainer.train_step().metrics
        if i >= warmup:
            records.append(metrics)
    trainer.logger.close()
    trainer.engine.close()
    return {k: statistics.mean(r[k] for r in records) for k in STEP_KEYS}


def part1(opts) -> None:
    print("== podsrl vs TRL GRPOTrainer: untrained tiny model, n = 16, 16 new tokens, beta = 0, lr 1e-4")
    print(f"{'rollouts':>8} {'framework':>9} {'gen roll/s':>10} {'gen tok/s':>10} {'upd roll/s':>10} "
          f"{'upd tok/s':>10} {'step s':>8} {'step roll/s':>11}")
    if not opts.skip_trl:
        from datasets import Dataset

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from trl_step import run as trl_run

        dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(10, 40) for b in range(10, 20)],
                                     "answer": [str(a + b) for a in range(10, 40) for b in range(10, 20)]})
    for rollouts in (64, 256):
        prompts = rollouts // 16
        p = podsrl_steps([f"rollout.prompts_per_step={prompts}", "rollout.n=16", "method=grpo",
                          "rollout.max_new_tokens=16", "warmup.steps=0", "optim.lr=1e-4",
                          f"optim.micro_batch_size={rollouts}"], opts.steps)
        gen_tok = p["tokens/generated"] / p["time/generate"]
        upd_tok = p["tokens/trained"] / p["time/update"]
        print(f"{rollouts:>8} {'podsrl':>9} {rollouts / p['time/generate']:>10.0f} {gen_tok:>10.0f} "
              f"{rollouts / p['time/update']:>10.0f} {upd_tok:>10.0f} {p['time/step']:>8.3f} "
              f"{rollouts / p['time/step']:>11.0f}")
        if opts.skip_trl:
            continue
        trl_opts = SimpleNamespace(prompts=prompts, max_new_tokens=16, warmup=1, steps=opts.steps)
        step_times, gen_times = trl_run(f"trl{rollouts}", 16, None, trl_opts, dataset)
        t_step, t_gen = statistics.mean(step_times), statistics.mean(gen_times)
        print(f"{rollouts:>8} {'TRL':>9} {rollouts / t_gen:>10.0f} {'':>10} {rollouts / (t_step - t_gen):>10.0f} "
              f"{'':>10} {t_step:>8.3f} {rollouts / t_step:>11.0f}")
        print(f"{rollouts:>8} {'ratio':>9} {t_gen / p['time/generate']:>10.2f} {'':>10} "
              f"{(t_step - t_gen) / p['time/update']:>10.2f} {'':>10} {'':>8} {t_step / p['time/step']:>10.2f}x")
    print("(TRL's 'upd' column is its step time minus generation: scoring, advantages, loss, backward, optimiser)")


def part2(opts) -> None:
    print("\n== built-in task, warmed-up model, default engine: PODS 64->16 vs GRPO 16-16 (32 prompts/step)")
    results = {}
    for name, n, m in (("grpo 16-16", 16, 16), ("pods 64->16", 64, 16)):
        results[name] = podsrl_steps([f"rollout.n={n}", "method=pods", f"pods.m={m}"], opts.steps)
    print(f"{'setup':<12} {'step s':>8} {'generate':>9} {'score':>7} {'select':>7} {'update':>7} "
          f"{'gen tokens':>10} {'trained tokens':>14}")
    for name, r in results.items():
        print(f"{name:<12} {r['time/step']:>8.3f} {r['time/generate']:>9.3f} {r['time/score']:>7.3f} "
              f"{r['time/select']:>7.4f} {r['time/update']:>7.3f} {r['tokens/generated']:>10.0f} "
              f"{r['tokens/trained']:>14.0f}")
    ratio = results["pods 64->16"]["time/step"] / results["grpo 16-16"]["time/step"]
    share = results["pods 64->16"]["time/select"] / results["pods 64->16"]["time/step"]
    print(f"ratio PODS 64->16 / GRPO 16-16 step time: {ratio:.2f} (target <= 1.3); "
          f"selection share of the PODS step: {100 * share:.2f}% (target < 1%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per setup (after one untimed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-task", action="store_true")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    part1(opts)
    if not opts.skip_task:
        part2(opts)
    print(f"(benchmark took {time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()
