"""Steps per second of the synchronous loop vs generation one step ahead (train.async, max_staleness 1) at equal
cores, on the built-in task with the warmed-up model, for GRPO 16-16 (grpo.yaml) and PODS 64->16 (pods.yaml).

Arms: `sync` runs generation and update in turn on `--threads` torch threads (one process); `async` runs the same
config with train.async.enabled, the generator thread on threads // 2 and the learner on the rest (one each on 2
cores); `sync_half` (with `--arms`) runs in turn on threads // 2, the overlap's effect without the thread split. On a
machine shared with other jobs, OpenMP regions of several threads wait at barriers for threads that are descheduled:
the sync arm then suffers far more than the one-thread sides of the async arm, so measure on a quiet machine. Each block builds a fresh trainer, takes `--warm` untimed steps (the async pipeline fills), then times
`--steps` steps by the wall clock; blocks of the four (config, arm) pairs alternate, in reversed order every other
repeat, `--repeats` times. Prints per config and arm the median steps/s with its min-max spread, the median of the
per-repeat ratios async/sync, the generate/update split of the sync arm and the async arm's learner wait (time the
learner had no batch) and generator idle (time the generator had no weights), and the machine.

Overlap pays most where generation and update cost about the same: sync steps/s = 1 / (g + u), async at best
1 / max(g', u') where g', u' are the times on half the threads each.

    python benchmarks/async_overlap.py [--repeats 5] [--steps 10] [--warm 2] [--threads 2] [--configs grpo pods]
                                       [--arms sync async sync_half] [--warmup-cache DIR] [--json FILE]
                                       [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from podsrl.config import load_config  # noqa: E402
from podsrl.config.presets import preset_path  # noqa: E402
from podsrl.run.trainer import Trainer  # noqa: E402

# sync: the process's threads, generation and update in turn; async: the same threads split between generator and
# learner; sync_half: in turn on half the threads (what each async side gets: overlap alone, without the split)
ARMS = ("sync", "async", "sync_half")


def build(config: str, arm: str, threads: int, seed: int, warmup_cache: str | None, extra: list[str]) -> Trainer:
    # the async trainer splits them between generator and learner
    torch.set_num_threads(max(1, threads // 2) if arm == "sync_half" else threads)
    overrides = [f"output_dir={tempfile.mkdtemp(prefix='podsrl_async_')}", f"seed={seed}", "log.progress=false",
                 "log.tensorboard=false", "log.plot=false", "train.max_seconds=0", "train.max_steps=100000",
                 f"train.async.enabled={'true' if arm == 'async' else 'false'}", "train.async.max_staleness=1"]
    if warmup_cache:
        overrides.append(f"warmup.cache_dir={warmup_cache}")
    return Trainer(load_config(preset_path(config), overrides + extra))


def block(config: str, arm: str, args, seed: int) -> dict:
    trainer = build(config, arm, args.threads, seed, args.warmup_cache, args.set)
    try:
        for _ in range(args.warm):
            trainer.train_step()
        t0 = time.perf_counter()
        records = [trainer.train_step().metrics for _ in range(args.steps)]
        wall = time.perf_counter() - t0
    finally:
        trainer.close_engines()
        torch.set_num_threads(args.threads)
    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in records)

    return {"steps_per_s": args.steps / wall, "generate": mean("time/generate") + mean("time/score"),
            "update": mean("time/update"), "learner_wait": mean("time/learner_wait"),
            "generator_idle": mean("time/generator_idle")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--warm", type=int, default=2, help="untimed steps per block (the async pipeline fills)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the process (async: split in two)")
    p.add_argument("--configs", nargs="+", default=["grpo", "pods"])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=["sync", "async"])
    p.add_argument("--warmup-cache", help="warmup.cache_dir (default: the config's)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every arm, e.g. "
                   "a larger model: model.tiny.hidden_size=384 model.tiny.num_layers=6 ... warmup.steps=0")
    p.add_argument("--json", help="also write the raw blocks here")
    args = p.parse_args()
    pairs = [(c, a) for c in args.configs for a in args.arms]
    results: dict[tuple[str, str], list[dict]] = {pair: [] for pair in pairs}
    for r in range(args.repeats):
        for config, arm in pairs if r % 2 == 0 else pairs[::-1]:
            results[(config, arm)].append(block(config, arm, args, seed=r + 1))
            print(f"repeat {r + 1} {config} {arm}: {results[(config, arm)][-1]['steps_per_s']:.3f} steps/s",
                  flush=True)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, {args.threads} threads (async: generator {max(1, args.threads // 2)}, learner "
          f"{max(1, args.threads - max(1, args.threads // 2))}); {args.steps} timed steps per block, {args.repeats} "
          f"repeats, arms alternating")
    print(f"{'config':8} {'arm':9} {'steps/s median [min, max]':28} {'gen+score s':>11} {'update s':>9} "
          f"{'learner wait':>12} {'gen idle':>9}")
    for config, arm in pairs:
        blocks = results[(config, arm)]
        rate = [b["steps_per_s"] for b in blocks]
        med = {key: statistics.median(b[key] for b in blocks)
               for key in ("generate", "update", "learner_wait", "generator_idle")}
        print(f"{config:8} {arm:9} {statistics.median(rate):7.3f} [{min(rate):.3f}, {max(rate):.3f}]{'':8} "
              f"{med['generate']:11.3f} {med['update']:9.3f} {med['learner_wait']:12.3f} {med['generator_idle']:9.3f}")
    for config in args.configs:
        for base in [a for a in args.arms if a != "async" and "async" in args.arms]:
            ratios = [a["steps_per_s"] / s["steps_per_s"]
                      for a, s in zip(results[(config, "async")], results[(config, base)])]
            print(f"{config}: async/{base} steps/s, median of per-repeat ratios {statistics.median(ratios):.2f} "
                  f"[{min(ratios):.2f}, {max(ratios):.2f}]")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{c}/{a}": v for (c, a), v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
