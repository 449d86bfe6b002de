"""Peak memory of the update phase: GRPO 16-16 vs PODS 64->16 vs GRPO 64-64 on the same model, and PODS 64->16 with
`update.activation_checkpointing` (each decoder layer keeps only its input and is recomputed in the backward).

Each setting runs in a fresh process, `--repeats` (>= 5) times in interleaved rounds (median and range reported), on a
synthetic batch with the real selection and update code. The update is done without gradient accumulation
(micro-batch = whole batch) because that is where memory follows the number of trained rollouts. CPU: peak resident
memory during the update minus resident memory just before it. CUDA: peak allocated bytes
(torch.cuda.max_memory_allocated) minus allocated bytes before.

    python benchmarks/update_memory.py            # prints a table; targets: PODS <= 1.15x GRPO 16-16, <= 0.5x 64-64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import MIN_REPEATS, Spread, load_average, machine_line, peak_memory_during, ratio

# (n, m, activation checkpointing)
SETTINGS = {"grpo 16-16": (16, 16, False), "pods 64->16": (64, 16, False), "grpo 64-64": (64, 64, False),
            "pods 64->16 ckpt": (64, 16, True)}


def measure(n: int, m: int, checkpointing: bool, prompts: int, length: int, layers: int, width: int,
            device: str) -> dict:
    import torch

    from podsrl.batch import Problem, RolloutBatch
    from podsrl.config import load_config
    from podsrl.config.facts import run_facts
    from podsrl.methods import METHODS, offline_context
    from podsrl.models.loading import build_char_tokenizer, build_tiny_model
    from podsrl.update import PolicyUpdater, UpdateSettings

    torch.manual_seed(0)
    rows = prompts * n
    cfg = load_config(None, [f"rollout.n={n}", "method=pods", f"pods.m={m}", f"rollout.max_new_tokens={length}",
                             f"optim.micro_batch_size={rows}", f"model.tiny.num_layers={layers}",
                             f"model.tiny.hidden_size={width}", f"model.tiny.intermediate_size={3 * width}",
                             f"model.tiny.max_position_embeddings={length + 16}",
                             f"update.activation_checkpointing={str(checkpointing).lower()}",
                             "model.compute_dtype=float32"])  # as docs/results.md reports it (auto: bf16 on CUDA)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg.model.tiny, tokenizer).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    updater = PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg), run_facts(cfg, torch.device(device)))
    problems = [Problem(uid=str(i), prompt="", answer="") for i in range(prompts)]
    batch = RolloutBatch(
        problems=problems, group_index=torch.arange(prompts).repeat_interleave(n),
        prompt_ids=torch.randint(3, 100, (rows, 8)), prompt_mask=torch.ones(rows, 8, dtype=torch.long),
        completion_ids=torch.randint(3, 100, (rows, length)), completion_mask=torch.ones(rows, length),
        truncated=torch.zeros(rows, dtype=torch.bool), rewards=(torch.rand(rows) < 0.4).float(),
    )
    batch.correct = batch.rewards > 0.5
    kept, _ = METHODS[cfg.method](cfg).select(batch, offline_context(cfg, torch.Generator().manual_seed(0)))
    # One warm-up update so optimiser state and allocator pools exist before we measure.
    updater.update(kept, torch.Generator().manual_seed(0))
    peak = peak_memory_during(lambda: updater.update(kept, torch.Generator().manual_seed(0)), device)
    params = sum(p.numel() for p in model.parameters())
    return {"trained_rows": kept.num_rollouts, "peak_bytes": peak, "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=64, help="completion tokens per rollout")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved rounds (median, range)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        n, m, checkpointing = map(int, args.child.split(","))
        print(json.dumps(measure(n, m, bool(checkpointing), args.prompts, args.length, args.layers, args.width,
                                 args.device)))
        return
    def child(n: int, m: int, checkpointing: bool) -> dict:
        out = subprocess.run([sys.executable, __file__, "--child", f"{n},{m},{int(checkpointing)}", "--prompts",
                              str(args.prompts), "--length", str(args.length), "--layers", str(args.layers),
                              "--width", str(args.width), "--device", args.device], capture_output=True, text=True, check=True,
                             env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})  # freed tensors leave the RSS
        return json.loads(out.stdout.strip().splitlines()[-1])

    print(machine_line(device=args.device) + " (each setting in a child process, same threads)")
    # Interleaved rounds (benchmarks/timing.py's rule, for memory): round r runs every setting once, rotated.
    names = list(SETTINGS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            runs[name].append(child(*SETTINGS[name]))
    peaks = {name: [run["peak_bytes"] for run in rs] for name, rs in runs.items()}
    params = runs[names[0]][0]["params"]
    print(f"update-phase peak memory, {params / 1e6:.1f}M-param model, {args.prompts} prompts, "
          f"{args.length} completion tokens, device {args.device}, {args.repeats} interleaved rounds")
    print(f"{'setting':<18}{'trained rows':>14}{'peak MiB, median [min-max]':>32}{'vs grpo 16-16':>24}")
    base = peaks["grpo 16-16"]
    for name in names:
        mib = Spread.of(peaks[name]).text(1 / 2**20, 1)
        print(f"{name:<18}{runs[name][0]['trained_rows']:>14}{mib:>32}{ratio(peaks[name], base).text(unit='x'):>24}")
    pods, big = ratio(peaks["pods 64->16"], base), ratio(peaks["pods 64->16"], peaks["grpo 64-64"])
    ckpt = ratio(peaks["pods 64->16 ckpt"], peaks["pods 64->16"])
    print(f"PODS / GRPO 16-16 = {pods.text()} (target <= 1.15); PODS / GRPO 64-64 = {big.text()} (target <= 0.5); "
          f"PODS with / without activation checkpointing = {ckpt.text()}; per-round ratios, median [min-max]; "
          f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
