"""A training step's memory, phase by phase, as a run meets it, against `podsrl plan --memory`'s prediction.

Where benchmarks/memory_plan_check.py measures each phase alone in a fresh process, this one runs the sequence a run
does, in one process, so whatever a phase leaves behind is in the next one's peak: one eval call first (greedy, as
many rows as eval.batch_size; released after it, as the trainer does), then two steps of generation (P prompts x n
rollouts, sampled in the compute dtype from the engine's copy of float32 masters) and the update (the shared-prompt
path, AdamW; the first step allocates its state, the second is the steady state), as the trainer does it: the
engine's kept decode state released before each update, the gradients freed after it. Every rollout runs to the full length (the EOS logit is biased far down). Each phase's
peak is the CUDA allocator's (`max_memory_allocated`, and `max_memory_reserved`: what the process really holds),
its level before and after, and the plan's terms for a training run (podsrl/planning/memory.py) beside them. On the CPU
the peak is the resident set (`--device cpu`: the plumbing at tiny sizes; the CPU's own validation is
memory_plan_check.py). Each activation-checkpointing setting runs in its own child process (exact peaks).

    python benchmarks/phase_memory.py --device cuda                     # Qwen2.5-0.5B's shape, GRPO 8 x 16, 256 tokens
    python benchmarks/phase_memory.py --device cpu --model tiny --prompts 2 --n 2 --length 8 --eval-rows 4   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import machine_line, memory_levels

PROMPT = 64
MIB = 2**20


def run_sequence(args, checkpointing: bool) -> list[dict]:
    """The eval call, then two (generation, update) steps; one row of measurements per phase."""
    import torch

    from benchmarks.gpu_generation import build_model
    from podsrl.batch import Problem, RolloutBatch
    from podsrl.config import load_config
    from podsrl.config.facts import run_facts
    from podsrl.engines.base import SamplingParams
    from podsrl.engines.fast import FastEngine
    from podsrl.update import PolicyUpdater, UpdateSettings

    device, compute = args.device, getattr(torch, args.compute_dtype)
    zero = memory_levels(lambda: None, device)["before"]
    model, _, _ = build_model(args.model, device, torch.float32)
    model.train()
    vocab = model.config.vocab_size
    # as podsrl/build.py builds it: sampling from a copy in the compute dtype when it is narrower than the masters
    engine = FastEngine(model, None, eos_token_id=1, pad_token_id=0,
                        weights_dtype=None if compute == torch.float32 else compute)
    overrides = [f"rollout.n={args.n}", "method=grpo", f"rollout.max_new_tokens={args.length}",
                 f"optim.micro_batch_size={args.micro_batch}", f"model.compute_dtype={args.compute_dtype}",
                 "algo.rollout_correction=none", f"update.activation_checkpointing={str(checkpointing).lower()}"]
    cfg = load_config(None, overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    updater = PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg), run_facts(cfg, torch.device(device)))
    gen = torch.Generator().manual_seed(0)
    eval_prompts = [torch.randint(2, vocab, (PROMPT,), generator=gen).tolist() for _ in range(args.eval_rows)]
    prompts = eval_prompts[: args.prompts]
    rows = args.prompts * args.n
    sampling = SamplingParams(max_new_tokens=args.length, temperature=1.0)
    greedy = SamplingParams(max_new_tokens=args.length, greedy=True, return_logprobs=False)
    out: list[dict] = []

    def record(phase: str, step: int, call) -> object:
        """Run `call` as phase `phase` of step `step`, measured; its result."""
        result = []
        levels = memory_levels(lambda: result.append(call()), device)
        out.append({"phase": phase, "step": step, **{k: v - zero for k, v in levels.items()}})
        return result[0]

    record("eval", 0, lambda: (engine.generate(eval_prompts, [1] * len(eval_prompts), greedy,
                                               torch.arange(len(eval_prompts))), engine.release()))
    for step in (1, 2):
        g = record("generation", step, lambda: engine.generate(prompts, [args.n] * args.prompts, sampling,
                                                               torch.arange(rows)))
        batch = RolloutBatch(problems=[Problem(uid=str(i), prompt="", answer="") for i in range(args.prompts)],
                             group_index=g.group_index.cpu(), prompt_ids=g.prompt_ids.cpu(),
                             prompt_mask=g.prompt_mask.cpu(), completion_ids=g.completion_ids.cpu(),
                             completion_mask=g.completion_mask.cpu(), truncated=g.truncated.cpu(),
                             rewards=torch.rand(rows, generator=gen))
        batch.advantages = torch.randn(rows, generator=gen)
        del g  # the engine's output (on the device) is not kept through the update; the batch moved to the CPU
        record("update", step, lambda b=batch, s=step: train_step(updater, optimizer, engine, model, b, s))
    return out


def train_step(updater, optimizer, engine, model, batch, step: int) -> None:
    """As the trainer (podsrl/run/trainer.py train_step): the engine's kept decode state released, the update, the
    gradients freed (their memory is free for generation), the engine synced."""
    import torch

    engine.release()
    updater.update(batch, torch.Generator().manual_seed(step))
    optimizer.zero_grad(set_to_none=True)
    engine.sync_weights(model)


def predict(args, checkpointing: bool) -> dict[str, dict[str, int]]:
    """The plan's terms for this workload in a training run: generation and the update."""
    from benchmarks.gpu_generation import build_model
    from podsrl.planning.memory import generation_peak, update_peak
    from podsrl.planning.workload import Workload, model_shape

    model, _, _ = build_model(args.model, "meta", __import__("torch").float32)
    shape = model_shape(model.config)
    work = Workload(args.prompts, args.n, args.n, PROMPT, args.length, compute_dtype=args.compute_dtype,
                    device="cuda" if args.device.startswith("cuda") else "cpu", training_run=True)
    return {"generation": generation_peak(shape, work), "update": update_peak(shape, work, args.micro_batch,
                                                                              checkpointing)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="0.5b", help="a benchmarks/gpu_generation.py model name (0.5b, tiny, ...)")
    parser.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--length", type=int, default=256, help="new tokens per rollout (prompts: 64 tokens)")
    parser.add_argument("--eval-rows", type=int, default=1024, help="rows of the eval call (eval.batch_size)")
    parser.add_argument("--micro-batch", type=int, default=16, help="optim.micro_batch_size")
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--json", help="also write the rows as JSON")
    parser.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_sequence(args, args.child == "on")))
        return
    print(machine_line(device=args.device), flush=True)
    print(f"Qwen2 '{args.model}' shape, float32 masters, {args.compute_dtype} compute; eval call {args.eval_rows} rows "
          f"greedy; GRPO {args.prompts} x {args.n}, prompts {PROMPT} + {args.length} new tokens, micro-batch "
          f"{args.micro_batch}; MiB above the process's start\n")
    print("| checkpointing | phase | step | before | peak allocated | peak reserved | after | predicted | "
          "predicted / peak | largest predicted terms (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows, failures = [], []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for setting in args.checkpointing:
        child = [a for a in sys.argv[1:] if a != "--json"] + ["--child", setting]
        result = subprocess.run([sys.executable, __file__, *child], capture_output=True, text=True, env=env)
        if result.returncode:
            print(f"| {setting} | failed (exit {result.returncode}): its error follows the table | | | | | | | | |",
                  flush=True)
            failures.append(f"checkpointing {setting}, the child's last lines:\n" + "\n".join(
                result.stderr.strip().splitlines()[-30:]))
            continue
        terms = predict(args, setting == "on")
        for row in json.loads(result.stdout.strip().splitlines()[-1]):
            plan = terms.get(row["phase"])
            predicted = sum(plan.values()) if plan else None
            top = (", ".join(f"{k} {v / MIB:.0f}" for k, v in sorted(plan.items(), key=lambda kv: -kv[1])[:4])
                   if plan else "")
            ratio = f"{predicted / row['peak']:.2f}" if predicted and row["peak"] > 0 else ""
            print(f"| {setting} | {row['phase']} | {row['step']} | {row['before'] / MIB:.0f} | {row['peak'] / MIB:.0f} | "
                  f"{row['reserved'] / MIB:.0f} | {row['after'] / MIB:.0f} | "
                  f"{'' if predicted is None else f'{predicted / MIB:.0f}'} | {ratio} | {top} |", flush=True)
            rows.append({**row, "checkpointing": setting, "predicted": predicted, "terms": plan})
    print("\npredicted: the plan's phase peak for a training run (podsrl/planning/memory.py generation_peak, update_peak); "
          "an eval call has no row of its own in the plan: what it leaves shows in the next phases' 'before'.")
    for failure in failures:
        print("\n" + failure)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
