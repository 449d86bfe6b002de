"""`podsrl plan --memory` against measured peaks on this CPU: random-init Qwen2 models of ~1M, ~13M and ~54M
parameters (and "0", a ~2k-parameter model whose peak is the runtime's own growth: the calibration case of
podsrl/planning/memory.py RUNTIME_BYTES, left out of the largest error), two completion lengths, the update (podsrl's PolicyUpdater, shared-prompt path, two micro-batches) and
generation (the fast engine, all rows at once).

Each (model, length, phase) runs in a fresh child process (benchmarks/update_memory.py's method): the resident set
size before the model is built is the zero, the peak is sampled every 0.2 ms while the measured call runs
(benchmarks/timing.py peak_memory_during), and glibc returns freed tensors to the system (MALLOC_MMAP_THRESHOLD_),
so the RSS follows live tensors. The update is measured on its second call (the first allocates AdamW's state), so
the peak holds weights, gradients, optimiser state and one micro-batch's activations, as the prediction does.
Generation is measured on its first call with the model alone in the process (no optimiser), predicted likewise
(Workload.training_run=False). Rounds are interleaved over the cases; the table gives the median of the rounds.

    OMP_NUM_THREADS=1 python benchmarks/memory_plan_check.py              # the table in docs/results.md
    OMP_NUM_THREADS=1 python benchmarks/memory_plan_check.py --checkpointing --phases update
    OMP_NUM_THREADS=1 python benchmarks/memory_plan_check.py --phases update --world-size 2 --strategy fsdp
                                                # per rank under torchrun (gloo): each rank's peak, the largest
    python benchmarks/memory_plan_check.py --device cuda --models 0.5B --compute-dtype bfloat16 --rounds 1
                                                # on a GPU: the allocator's peaks (one round: they are exact)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import load_average, machine_line, peak_memory_during

# name -> (hidden, layers, heads, kv heads, vocab, MLP width); tied embeddings (gsm8k_shape's layout); "0.5B" is
# Qwen2.5-0.5B's shape (for a GPU: --device cuda)
MODELS = {"0": (16, 1, 2, 1, 32, 48), "1M": (128, 4, 4, 2, 1000, 384), "13M": (256, 6, 4, 2, 32000, 768),
          "54M": (512, 12, 8, 4, 32000, 1536), "0.5B": (896, 24, 14, 2, 151936, 4864)}
CPU_MODELS = ["0", "1M", "13M", "54M"]
PROMPT = 64
LENGTHS = (64, 256)
UPDATE = {"prompts": 2, "m": 8, "micro_batch": 8}  # 16 trained rows, two micro-batches of one prompt each
GENERATION = {"prompts": 4, "n": 16}  # 64 rows in flight
AIM = 0.15


def qwen2_config(name: str):
    from transformers import Qwen2Config

    hidden, layers, heads, kv_heads, vocab, intermediate = MODELS[name]
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=PROMPT + max(LENGTHS) + 8, tie_word_embeddings=True,
                       pad_token_id=0, eos_token_id=1, bos_token_id=None)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _level(device: str) -> int:
    """Bytes in use now: the CUDA allocator's, or the process's resident set on CPU."""
    import torch

    return torch.cuda.memory_allocated() if device.startswith("cuda") else _rss()


def measure_update(name: str, length: int, checkpointing: bool, compute: str, device: str,
                   strategy: str = "ddp") -> int:
    """The update's peak in this process; under torchrun this rank's, with the strategy's data-parallel object
    (the process group is joined before the zero is taken: its buffers are not the plan's)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from podsrl.batch import Problem, RolloutBatch
    from podsrl.config import load_config
    from podsrl.config.facts import run_facts
    from podsrl.distributed import init_distributed
    from podsrl.fsdp import build_data_parallel
    from podsrl.update import PolicyUpdater, UpdateSettings

    prompts, m = UPDATE["prompts"], UPDATE["m"]
    rows = prompts * m
    overrides = [f"rollout.n={m}", "method=grpo", f"rollout.max_new_tokens={length}",
                 f"optim.micro_batch_size={UPDATE['micro_batch']}", f"model.compute_dtype={compute}",
                 "algo.rollout_correction=none",  # the synthetic batch has no sampler log-probs ([R, Lc]: negligible)
                 f"train.strategy={strategy}"]
    if checkpointing:
        overrides.append("update.activation_checkpointing=true")
    cfg = load_config(None, overrides)
    gen = torch.Generator().manual_seed(0)
    vocab = MODELS[name][4]
    batch = RolloutBatch(
        problems=[Problem(uid=str(i), prompt="", answer="") for i in range(prompts)],
        group_index=torch.arange(prompts).repeat_interleave(m),
        prompt_ids=torch.randint(2, vocab, (prompts, PROMPT), generator=gen).repeat_interleave(m, 0),
        prompt_mask=torch.ones(rows, PROMPT, dtype=torch.long),
        completion_ids=torch.randint(2, vocab, (rows, length), generator=gen),
        completion_mask=torch.ones(rows, length), truncated=torch.zeros(rows, dtype=torch.bool),
        rewards=torch.rand(rows, generator=gen),
    )
    batch.advantages = torch.randn(rows, generator=gen)
    ctx = init_distributed(torch.device(device))
    zero = _level(device)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(name)).to(device)
    data_parallel = build_data_parallel(ctx, model, None, cfg)  # FSDP2 shards `model` in place
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    updater = PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg), run_facts(cfg, torch.device(device)),
                            data_parallel=data_parallel)
    updater.update(batch, torch.Generator().manual_seed(0))  # AdamW's state exists from here on
    before = _level(device)
    return before - zero + peak_memory_during(lambda: updater.update(batch, torch.Generator().manual_seed(0)),
                                              device)


def measure_generation(name: str, length: int, compute: str, device: str) -> int:
    import torch
    from transformers import Qwen2ForCausalLM

    from podsrl.engines.base import SamplingParams
    from podsrl.engines.fast import FastEngine

    prompts, n = GENERATION["prompts"], GENERATION["n"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, MODELS[name][4], (prompts, PROMPT), generator=gen).tolist()
    zero = _level(device)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(name)).to(device)
    # as a run builds it (podsrl/build.py): sampling from a copy in the compute dtype when it is narrower
    engine = FastEngine(model, None, eos_token_id=1, pad_token_id=0,
                        weights_dtype=None if compute == "float32" else getattr(torch, compute))
    params = SamplingParams(max_new_tokens=length, temperature=1.0)
    seeds = torch.arange(prompts * n)
    before = _level(device)
    return before - zero + peak_memory_during(lambda: engine.generate(ids, [n] * prompts, params, seeds), device)


def predict(name: str, length: int, phase: str, checkpointing: bool, compute: str = "float32",
            device: str = "cpu", world_size: int = 1, strategy: str = "ddp") -> dict[str, int]:
    from podsrl.planning.memory import generation_peak, update_peak
    from podsrl.planning.workload import Workload, model_shape

    shape = model_shape(qwen2_config(name))
    if phase == "update":
        work = Workload(UPDATE["prompts"], UPDATE["m"], UPDATE["m"], PROMPT, length, compute_dtype=compute,
                        device=device, training_run=False, world_size=world_size, strategy=strategy)
        return update_peak(shape, work, UPDATE["micro_batch"], checkpointing)
    work = Workload(GENERATION["prompts"], GENERATION["n"], GENERATION["n"], PROMPT, length, compute_dtype=compute,
                    device=device, training_run=False)
    return generation_peak(shape, work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=CPU_MODELS, choices=list(MODELS))
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    parser.add_argument("--phases", nargs="+", default=["update", "generation"], choices=["update", "generation"])
    parser.add_argument("--checkpointing", action="store_true", help="the update with activation checkpointing")
    parser.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model.compute_dtype over float32 masters (the update's autocast, the engine's copy)")
    parser.add_argument("--device", default="cpu", help="cpu (resident set) or cuda (the allocator's peak)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case (median)")
    parser.add_argument("--world-size", type=int, default=1,
                        help="update only: torchrun ranks (gloo on CPU), each rank's peak measured, the largest kept")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"], help="train.strategy (--world-size > 1)")
    parser.add_argument("--json", help="also write the rows as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, length, phase = args.child.split(",")
        peak = (measure_update(name, int(length), args.checkpointing, args.compute_dtype, args.device, args.strategy)
                if phase == "update" else measure_generation(name, int(length), args.compute_dtype, args.device))
        print(json.dumps({"peak": peak}), flush=True)
        return
    if args.world_size > 1 and args.phases != ["update"]:
        parser.error("--world-size: the per-rank check is the update's (--phases update)")
    launcher = [sys.executable] if args.world_size == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.world_size)]
    cases = [(name, length, phase) for name in args.models for length in args.lengths for phase in args.phases]
    print(machine_line() + " (each case in a child process)")
    measured: dict[tuple, list[int]] = {case: [] for case in cases}
    for r in range(args.rounds):
        k = r % len(cases)
        for case in cases[k:] + cases[:k]:
            out = subprocess.run(
                [*launcher, __file__, "--child", ",".join(map(str, case))]
                + (["--checkpointing"] if args.checkpointing else [])
                + ["--compute-dtype", args.compute_dtype, "--device", args.device, "--strategy", args.strategy],
                capture_output=True, text=True, check=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
            ranks = [int(p) for p in re.findall(r'\{"peak": (\d+)\}', out.stdout)]  # ranks' lines may interleave
            assert len(ranks) == args.world_size, out.stdout
            measured[case].append(max(ranks))
    mib = 2**20
    ckpt = "with" if args.checkpointing else "without"
    print(f"\nupdate: {UPDATE['prompts']} prompts x {UPDATE['m']} rows, micro-batch {UPDATE['micro_batch']}, "
          f"{ckpt} activation checkpointing; generation: {GENERATION['prompts']} prompts x {GENERATION['n']} rows; "
          f"prompts {PROMPT} tokens; float32 masters, {args.compute_dtype} compute; {args.device}; {args.rounds} "
          "interleaved rounds, median [min-max]"
          + (f"; per rank of {args.world_size} (train.strategy={args.strategy}, the largest rank's peak)"
             if args.world_size > 1 else "") + "\n")
    print("| model | completion | phase | predicted MiB | measured MiB | error | largest predicted terms (MiB) |")
    print("|---|---|---|---|---|---|---|")
    rows, worst = [], 0.0
    for case in cases:
        name, length, phase = case
        terms = predict(name, length, phase, args.checkpointing, args.compute_dtype, args.device, args.world_size,
                        args.strategy)
        predicted, values = sum(terms.values()), measured[case]
        med = statistics.median(values)
        error = predicted / med - 1
        if name != "0":
            worst = max(worst, abs(error))
        top = ", ".join(f"{k} {v / mib:.0f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])[:3])
        label = "0 (calibration)" if name == "0" else name
        print(f"| {label} | {length} | {phase} | {predicted / mib:.1f} | {med / mib:.1f} "
              f"[{min(values) / mib:.1f}-{max(values) / mib:.1f}] | {error:+.1%} | {top} |")
        rows.append({"model": name, "completion": length, "phase": phase, "checkpointing": args.checkpointing,
                     "world_size": args.world_size, "strategy": args.strategy,
                     "compute_dtype": args.compute_dtype, "device": args.device,
                     "predicted": predicted, "measured": values, "terms": terms, "error": error})
    print(f"\nlargest |error| {worst:.1%} without the calibration model (aim {AIM:.0%}); load average after: "
          f"{load_average()}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
