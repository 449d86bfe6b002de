"""Update throughput of the shared-prompt path vs the plain path (`update.shared_prompt: true/false`).

Two workloads, each one whole `PolicyUpdater.update` per timed call (forwards, backwards, optimiser steps):
  default  the built-in default step's update: PODS 32 prompts x 64 -> 16 kept (512 rows), four mini-batches,
           micro-batches of 256, the built-in tiny model (podsrl/configs/default.yaml); prompts are the arithmetic
           task's, completions random digits of 2-6 tokens + EOS (the warmed-up model's lengths)
  gsm8k    a GSM8K-shaped synthetic step: a random-init Qwen2 with a 32k vocabulary (~13M parameters), 200-token
           prompts, completions of 50-400 tokens (uniform), one group of n = 16 rows, micro-batches of 16
  gsm8k-large  the same shape at GPU size, not in the default list: 8 groups of 16 rows on a ~110M-parameter Qwen2
Arms are interleaved (shared, plain, plain, shared, ...) on two copies of the same model, `--repeats` timed updates
each after one untimed; prints the median, min-max spread and the median of the per-repeat ratios. Then, per arm in a
fresh process, the update's peak memory: CPU, peak resident set size sampled every 0.2 ms during one update minus
the resident size just before it (MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB so freed tensors leave the RSS); CUDA,
torch.cuda.max_memory_allocated minus allocated before. FLOP/s: the work the update needs (6 x non-embedding
parameters per token, each group's prompt counted once, plus 6 x vocabulary x width per predicted token; attention
left out) over the median time, as a share of this machine's float32 GEMM rate measured with the same threads
once per round (the median of those).

`--attention` times the attention layout choice alone (forward + backward of one GSM8K-shaped group, 4 query and
2 key/value heads of dim 64): one packed sequence with a dense block mask vs the prompt's keys index-expanded to
length-bucketed completion rows (what podsrl/models/packed_layout.py does).

    python benchmarks/update_speed.py [--workload default gsm8k] [--repeats 5] [--threads 1] [--device cpu]
    python benchmarks/update_speed.py --attention
    python benchmarks/update_speed.py --ops      # ATen operations per update and arm (the GPU's launch count)
    python benchmarks/update_speed.py --activation-checkpointing [--workload gsm8k]

`--activation-checkpointing` times each path with and without `update.activation_checkpointing` instead (four arms,
each round in a rotated order) and measures each arm's peak memory in a fresh process as above.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import Spread, machine_line, peak_memory_during  # noqa: E402
from podsrl.batch import Problem, RolloutBatch  # noqa: E402
from podsrl.config import load_config  # noqa: E402
from podsrl.config.facts import run_facts
from podsrl.update import PolicyUpdater, UpdateSettings  # noqa: E402

DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "podsrl/configs/default.yaml")
KEPT = 16  # rollouts kept per prompt by the default PODS 64 -> 16


def default_workload(seed: int = 0):
    """The default step's update: model, config overrides and the 512-row batch."""
    from podsrl.models.loading import build_char_tokenizer, build_tiny_model
    from podsrl.tasks import build_task

    cfg = load_config(DEFAULT_CONFIG, [])
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg.model.tiny, tokenizer, seed=seed)
    task = build_task(cfg.task, tokenizer)
    prompts = [tokenizer(task.problem(i).prompt)["input_ids"] for i in range(cfg.rollout.prompts_per_step)]
    gen = torch.Generator().manual_seed(seed)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    completions = []
    for _ in prompts:
        for _ in range(KEPT):
            length = int(torch.randint(2, 7, (1,), generator=gen))
            completions.append([digits[int(i)] for i in torch.randint(0, 10, (length,), generator=gen)]
                               + [tokenizer.eos_token_id])
    batch = make_batch(prompts, KEPT, completions, tokenizer.pad_token_id, gen)
    # 256 rows, what the default run's auto size is on the CPU (and the default before auto), on every device, so the
    # figures docs/results.md quotes stay reproducible; the updater takes a decided size
    return model, DEFAULT_CONFIG, ["optim.micro_batch_size=256"], batch


def gsm8k_workload(seed: int = 0, groups: int = 1, hidden: int = 256, layers: int = 6, heads: int = 4):
    from benchmarks.gsm8k_shape import PROMPT_TOKENS, VOCAB, gsm8k_model

    n = 16
    model = gsm8k_model(seed, hidden, layers, heads)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(groups)]
    completions = [torch.randint(3, VOCAB, (int(torch.randint(50, 401, (1,), generator=gen)),),
                                 generator=gen).tolist() for _ in range(groups * n)]
    overrides = [f"rollout.n={n}", "optim.micro_batch_size=16", "rollout.max_new_tokens=400"]
    return model, None, overrides, make_batch(prompts, n, completions, 0, gen)


def gsm8k_large_workload(seed: int = 0):
    """A GPU-sized GSM8K-shaped step: 8 groups of 16 on a ~110M-parameter Qwen2 (width 768, 12 layers)."""
    return gsm8k_workload(seed, groups=8, hidden=768, layers=12, heads=12)


WORKLOADS = {"default": default_workload, "gsm8k": gsm8k_workload, "gsm8k-large": gsm8k_large_workload}


def make_batch(prompts: list[list[int]], n: int, completions: list[list[int]], pad: int,
               gen: torch.Generator) -> RolloutBatch:
    rows = len(completions)
    lp, lc = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.full((rows, lp), pad)
    prompt_mask = torch.zeros(rows, lp, dtype=torch.long)
    completion_ids = torch.full((rows, lc), pad)
    completion_mask = torch.zeros(rows, lc)
    for r, c in enumerate(completions):
        p = prompts[r // n]
        prompt_ids[r, lp - len(p):] = torch.tensor(p)
        prompt_mask[r, lp - len(p):] = 1
        completion_ids[r, :len(c)] = torch.tensor(c)
        completion_mask[r, :len(c)] = 1
    return RolloutBatch(
        problems=[Problem(uid=str(i), prompt="", answer="") for i in range(len(prompts))],
        group_index=torch.arange(len(prompts)).repeat_interleave(n), prompt_ids=prompt_ids,
        prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=completion_mask,
        truncated=torch.zeros(rows, dtype=torch.bool), advantages=torch.randn(rows, generator=gen))


def make_updater(model, config: str | None, overrides: list[str], shared: bool, device: str,
                 checkpointing: bool = False) -> PolicyUpdater:
    # float32 compute on every device, as docs/results.md reports it (`auto` would be bfloat16 on CUDA)
    cfg = load_config(config, ["model.compute_dtype=float32", *overrides, f"update.shared_prompt={str(shared).lower()}",
                               f"update.activation_checkpointing={str(checkpointing).lower()}"])
    model = model.to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg), run_facts(cfg, torch.device(device)))


def useful_flops(model, batch: RolloutBatch, cfg) -> float:
    """Forward + backward FLOPs the update needs (see the module docstring), all passes."""
    config = model.config
    embed = config.vocab_size * config.hidden_size
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    groups = batch.group_index.unique()
    prompt_tokens = sum(int(batch.prompt_mask[batch.group_index == g][0].sum()) for g in groups)
    completion_tokens = float(batch.completion_mask.sum())
    tokens = prompt_tokens + completion_tokens
    return cfg.optim.epochs * (6 * body * tokens + 6 * embed * completion_tokens)


def gemm_rate(device: str, repeats: int = 5) -> float:
    size = 8192 if device.startswith("cuda") else 1024  # a GPU needs a large product to reach its rate
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    times = []
    for _ in range(repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / min(times[1:])


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_arms(name: str, repeats: int, device: str) -> dict:
    model, config, overrides, batch = WORKLOADS[name]()
    arms = {s: make_updater(copy.deepcopy(model), config, overrides, s, device) for s in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    rates = []  # the GEMM rate, re-measured every round: on a shared machine it moves with the load
    for r in range(repeats + 1):
        rates.append(gemm_rate(device, repeats=2))
        for shared in (True, False) if r % 2 == 0 else (False, True):
            sync(device)
            t0 = time.perf_counter()
            arms[shared].update(batch, torch.Generator().manual_seed(r))
            sync(device)
            if r > 0:  # the first round is the untimed warm-up
                times[shared].append(time.perf_counter() - t0)
    flops = useful_flops(model, batch, arms[True].cfg)
    ratios = [p / s for s, p in zip(times[True], times[False])]
    return {"rows": batch.num_rollouts, "tokens": float(batch.completion_mask.sum() + batch.prompt_mask.sum()),
            "params": sum(p.numel() for p in model.parameters()), "times": times, "ratios": ratios,
            "flops": flops, "gemm_rate": statistics.median(rates)}


def attention_choice(repeats: int) -> None:
    from podsrl.models.attention import grouped_attention
    from podsrl.models.packed_layout import block_attention, build_plan

    gen = torch.Generator().manual_seed(0)
    lp, n, heads, kv_heads, dim = 200, 16, 4, 2, 64
    lengths = torch.randint(50, 401, (n,), generator=gen)
    width = int(lengths.max())
    plan = build_plan(torch.randint(3, 1000, (1, lp), generator=gen).expand(n, lp), torch.ones(n, lp, dtype=torch.long),
                      torch.randint(3, 1000, (n, width), generator=gen),
                      (torch.arange(width) < lengths[:, None]).float(), torch.device("cpu"))
    tokens = plan.ids.numel()

    # the packed stream's block mask: the prompt causal; completion r sees the prompt and its own earlier tokens
    row = torch.full((tokens,), -1)
    starts = lp + torch.cat([torch.zeros(1, dtype=torch.long), (lengths - 1).cumsum(0)[:-1]])
    for r in range(n):
        row[starts[r]: starts[r] + lengths[r] - 1] = r
    pos = torch.arange(tokens)
    block = (pos[:, None] >= pos[None, :]) & ((row[None, :] == -1) | (row[:, None] == row[None, :]))

    def packed(q, k, v):  # the same attention kernel as the update's, over one masked sequence
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        return grouped_attention(q, k, v, ~block[None, None], dim ** -0.5)[0].transpose(0, 1).flatten(1)

    def expanded(q, k, v):  # the update's own layout
        return block_attention(q, k, v, plan, dim ** -0.5)

    arms = {"packed, dense block mask": packed, "expanded prompt keys + length buckets": expanded}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(repeats + 1):
        for name in arms if r % 2 == 0 else list(arms)[::-1]:
            q, k, v = (torch.randn(tokens, h, dim, requires_grad=True) for h in (heads, kv_heads, kv_heads))
            t0 = time.perf_counter()
            arms[name](q, k, v).sum().backward()
            if r > 0:
                times[name].append(time.perf_counter() - t0)
    print(f"\n== attention layout, one group: {tokens} tokens, {len(plan.buckets)} length buckets, forward + backward")
    for name, t in times.items():
        print(f"  {name}: {spread(t)}")


def op_counts(names: list[str], device: str) -> None:
    """ATen operations one update runs, per arm (forward and backward; leaves only: each does work), and how many of
    the shared-prompt arm's are its plan's index work on CPU tensors (on a GPU those launch no kernel; the others
    launch at least one each, which is what a small update's time is made of)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import podsrl.update.shared_prompt as shared_prompt

    build_plan = shared_prompt.build_plan

    def labelled_build_plan(*args, **kwargs):
        with record_function("build_plan"):
            return build_plan(*args, **kwargs)

    def in_plan(event) -> bool:
        while event is not None:
            if event.name == "build_plan":
                return True
            event = event.cpu_parent
        return False

    shared_prompt.build_plan = labelled_build_plan
    try:
        for name in names:
            model, config, overrides, batch = WORKLOADS[name]()
            counts, plan_ops = {}, 0
            for shared in (True, False):
                updater = make_updater(copy.deepcopy(model), config, overrides, shared, device)
                updater.update(batch, torch.Generator().manual_seed(0))
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    updater.update(batch, torch.Generator().manual_seed(1))
                events = prof.events()
                parents = {id(e.cpu_parent) for e in events if e.cpu_parent is not None}
                leaves = [e for e in events if e.name.startswith("aten::") and id(e) not in parents]
                counts[shared] = len(leaves)
                if shared:
                    plan_ops = sum(map(in_plan, leaves))
            model_ops = counts[True] - plan_ops
            print(f"== {name}: ATen operations per update: shared-prompt {counts[True]:,} ({plan_ops:,} building its "
                  f"plans, {model_ops:,} the model's), plain {counts[False]:,}; model operations "
                  f"{model_ops / counts[False]:.2f}x the plain path's")
    finally:
        shared_prompt.build_plan = build_plan


CHECKPOINTING_ARMS = {"shared-prompt": (True, False), "shared-prompt + checkpointing": (True, True),
                      "plain": (False, False), "plain + checkpointing": (False, True)}


def checkpointing_arms(name: str, repeats: int, device: str, threads: int, memory: bool = True) -> None:
    """Each path with and without activation checkpointing: interleaved times (round r runs the arms rotated by r,
    the first round untimed) and, with `memory`, each arm's peak memory in a fresh process."""
    model, config, overrides, batch = WORKLOADS[name]()
    names = list(CHECKPOINTING_ARMS)
    arms = {k: make_updater(copy.deepcopy(model), config, overrides, CHECKPOINTING_ARMS[k][0], device,
                            CHECKPOINTING_ARMS[k][1]) for k in names}
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeats + 1):
        for k in names[r % 4:] + names[: r % 4]:
            sync(device)
            t0 = time.perf_counter()
            arms[k].update(batch, torch.Generator().manual_seed(r))
            sync(device)
            if r > 0:
                times[k].append(time.perf_counter() - t0)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(threads or "")}
    peaks = dict.fromkeys(names, float("nan"))
    for k in names if memory else []:
        shared, checkpointing = CHECKPOINTING_ARMS[k]
        out = subprocess.run([sys.executable, __file__, "--memory-child", f"{name},{int(shared)},{int(checkpointing)}",
                              "--threads", str(threads), "--device", device], capture_output=True, text=True,
                             check=True, env=env)
        peaks[k] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    how = "peak RSS delta" if device == "cpu" else "max_memory_allocated delta"
    print(f"\n== {name}, activation checkpointing: {batch.num_rollouts} rows, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {repeats} interleaved repeats per arm")
    print(f"  {'arm':<32}{'update time, median [min-max]':>34}{'peak MiB (' + how + ')':>36}")
    for k in names:
        print(f"  {k:<32}{spread(times[k]):>34}{peaks[k] / 2**20:>36.1f}")
    for path in ("shared-prompt", "plain"):
        with_ckpt, without = times[f"{path} + checkpointing"], times[path]
        r = [a / b for a, b in zip(with_ckpt, without)]
        print(f"  {path}: checkpointing time {statistics.median(r):.2f}x (per-repeat {min(r):.2f}-{max(r):.2f}x), "
              f"peak memory {peaks[f'{path} + checkpointing'] / max(peaks[path], 1):.2f}x")


def peak_memory(name: str, shared: bool, device: str, checkpointing: bool = False) -> int:
    """Bytes above the pre-update level during one update (after one warm-up update), in this process."""
    model, config, overrides, batch = WORKLOADS[name]()
    updater = make_updater(model, config, overrides, shared, device, checkpointing)
    updater.update(batch, torch.Generator().manual_seed(0))
    return peak_memory_during(lambda: updater.update(batch, torch.Generator().manual_seed(1)), device)


def spread(values: list[float]) -> str:
    return Spread.of(values).text(digits=3, unit=" s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", default=["default", "gsm8k"], choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--attention", action="store_true", help="only the attention layout comparison")
    parser.add_argument("--ops", action="store_true", help="only count the ATen operations of one update per arm")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="each path with and without update.activation_checkpointing (time and peak memory)")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.memory_child:
        name, shared, *checkpointing = opts.memory_child.split(",")
        print(json.dumps({"peak": peak_memory(name, shared == "1", opts.device, checkpointing == ["1"])}))
        return
    print(machine_line(device=opts.device))
    if opts.attention:
        attention_choice(opts.repeats)
        return
    if opts.ops:
        op_counts(opts.workload, opts.device)
        return
    if opts.activation_checkpointing:
        for name in opts.workload:
            checkpointing_arms(name, opts.repeats, opts.device, opts.threads, not opts.skip_memory)
        print(f"\nend load average: {os.getloadavg()[0]:.2f}")
        return
    for name in opts.workload:
        t0 = time.perf_counter()
        res = time_arms(name, opts.repeats, opts.device)
        shared_t, plain_t, rate = res["times"][True], res["times"][False], res["gemm_rate"]
        print(f"\n== {name}: {res['rows']} rows, {res['params'] / 1e6:.1f}M parameters, {opts.repeats} interleaved "
              f"repeats per arm")
        print(f"  shared-prompt update: {spread(shared_t)}  useful FLOP/s "
              f"{res['flops'] / statistics.median(shared_t) / 1e9:.1f} G = "
              f"{100 * res['flops'] / statistics.median(shared_t) / rate:.0f}% of GEMM rate")
        print(f"  plain update:         {spread(plain_t)}  useful FLOP/s "
              f"{res['flops'] / statistics.median(plain_t) / 1e9:.1f} G = "
              f"{100 * res['flops'] / statistics.median(plain_t) / rate:.0f}% of GEMM rate")
        size = 8192 if opts.device.startswith("cuda") else 1024
        print(f"  float32 GEMM rate ({size}^3 matmul, best of 2, measured every round; median): {rate / 1e9:.1f} GFLOP/s")
        r = res["ratios"]
        print(f"  speed-up plain/shared: median {statistics.median(r):.2f}x (per-repeat {min(r):.2f}-{max(r):.2f}x); "
              f"target >= {2.0 if name == 'default' else 1.4}x")
        if not opts.skip_memory:
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(opts.threads or "")}
            peaks = {}
            for shared in (True, False):
                out = subprocess.run([sys.executable, __file__, "--memory-child", f"{name},{int(shared)}", "--threads",
                                      str(opts.threads), "--device", opts.device], capture_output=True, text=True,
                                     check=True, env=env)
                peaks[shared] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
            how = "peak RSS delta" if opts.device == "cpu" else "max_memory_allocated delta"
            print(f"  peak memory ({how}): shared {peaks[True] / 2**20:.1f} MiB, plain {peaks[False] / 2**20:.1f} MiB "
                  f"({peaks[True] / max(peaks[False], 1):.2f}x)")
        print(f"  ({time.perf_counter() - t0:.0f} s)")
    print(f"\nend load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
