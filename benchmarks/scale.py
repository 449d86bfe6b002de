"""Scale-out figures: rollouts/s of the Ray pool (1 and 2 actors) and of torchrun-style sharded generation, and
update time for 1 and 2 data-parallel ranks (gloo), with the one-off and per-step overheads reported separately
(Ray start-up, actor start-up, weight broadcast; process-group start-up, gradient all-reduce); then FSDP2: each
rank's parameter + gradient + AdamW bytes with 1 process, DDP and FSDP2 on 2 ranks, and the step time of the three
arms interleaved in the same two processes (the overhead of sharding).

Every configuration is timed `--repeats` times, interleaved, and the median is reported; all run in one invocation
so the ratios are taken side by side on the same (possibly shared) machine. One rank or actor = one torch thread.

    python benchmarks/scale.py                      # built-in tiny model size, a few minutes on 2 cores
    python benchmarks/scale.py --hidden 256 --layers 6 --skip-ray
    python benchmarks/scale.py --skip-ray --skip-ddp          # the FSDP2 figures alone
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from podsrl.batch import Problem, RolloutBatch
from podsrl.config import TinyModelConfig, load_config
from podsrl.config.facts import run_facts
from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.fsdp import build_data_parallel
from podsrl.models.loading import build_char_tokenizer, build_tiny_model, count_parameters
from podsrl.update import PolicyUpdater, UpdateSettings


def make_model(args):
    cfg = TinyModelConfig(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=3 * args.hidden,
                          max_position_embeddings=128)
    tok = build_char_tokenizer()
    return build_tiny_model(cfg, tok, seed=0), tok


def request(args):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 40, (args.prompts,), generator=g)]
    counts = [args.n] * args.prompts
    return prompts, counts, torch.randint(0, 2**62, (sum(counts),), generator=g)


def make_batch(args) -> RolloutBatch:
    """A selected batch like the trainer's: rows x (prompt, completion) with random lengths and advantages."""
    g = torch.Generator().manual_seed(1)
    rows, lp, lc = args.update_rows, 40, args.max_new_tokens
    group_index = torch.arange(rows) // args.n
    prompt_mask = (torch.arange(lp) >= lp - torch.randint(16, lp, (rows,), generator=g)[:, None]).long()
    length = torch.randint(1, lc + 1, (rows,), generator=g)
    completion_mask = (torch.arange(lc) < length[:, None]).float()
    return RolloutBatch(
        problems=[Problem(uid=str(i), prompt="", answer="") for i in range(int(group_index.max()) + 1)],
        group_index=group_index, prompt_ids=torch.randint(3, 100, (rows, lp), generator=g) * prompt_mask,
        prompt_mask=prompt_mask, completion_ids=torch.randint(3, 100, (rows, lc), generator=g),
        completion_mask=completion_mask, truncated=length == lc, advantages=torch.randn(rows, generator=g))


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ------------------------------------------------------------------------------------------------ generation


def bench_ray(args, rows: list[tuple[str, str]]) -> None:
    import ray

    from podsrl.engines.ray import RayEngine

    model, tok = make_model(args)
    prompts, counts, seeds = request(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    n_rows = sum(counts)
    t0 = time.perf_counter()
    # 3 logical CPUs: both pools (1 + 2 actors) stay up for interleaved timing; only one pool runs at a time.
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR")
    rows.append(("ray.init (local)", f"{time.perf_counter() - t0:.2f} s"))
    torch.set_num_threads(1)
    local = FastEngine(model, tok)
    engines = {}
    for k in (1, 2):
        t0 = time.perf_counter()
        engines[k] = RayEngine(model, tok, num_workers=k)
        rows.append((f"pool start-up, {k} actor(s) (actors + model put)", f"{time.perf_counter() - t0:.2f} s"))
    gen = {"in-process fast engine, 1 thread": lambda: local.generate(prompts, counts, params, seeds)}
    for k, e in engines.items():
        gen[f"ray pool, {k} actor(s)"] = lambda e=e: e.generate(prompts, counts, params, seeds)
    for fn in gen.values():  # warm every path once
        fn()
    times: dict[str, list[float]] = {name: [] for name in gen}
    for _ in range(args.repeats):
        for name, fn in gen.items():
            times[name] += timed(fn, 1)
    base = statistics.median(times["in-process fast engine, 1 thread"])
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append((f"{name}: rollouts/s", f"{n_rows / med:8.1f}  ({med:.3f} s/call, x{base / med:.2f})"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    for k, e in engines.items():
        ts = timed(lambda e=e: e.sync_weights(model), args.repeats)
        rows.append((f"weight broadcast, {k} actor(s) (1 ray.put + loads)", f"{statistics.median(ts) * 1e3:.1f} ms"))
    for e in engines.values():
        e.close()
    ray.shutdown()


# ------------------------------------------------------------------------------------------------ data parallel


def _rank(rank: int, world: int, init: str, out: str, args, spawned_at: float) -> None:
    from podsrl.distributed import init_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ready = time.time() - spawned_at
    ctx = init_distributed(torch.device("cpu"))
    res = run_update_bench(args, ctx)
    res["startup"] = ready
    all_ready: list = [None] * world
    dist.all_gather_object(all_ready, ready)
    res["startup"] = max(all_ready)
    if rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()


def run_update_bench(args, ctx=None) -> dict:
    model, tok = make_model(args)
    cfg = load_config(None, [f"optim.micro_batch_size={args.micro}", f"rollout.max_new_tokens={args.max_new_tokens}"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    dp = build_data_parallel(ctx, model) if ctx is not None else None
    sync_times: list[float] = []
    if dp is not None:
        inner = dp.grad_sync

        def grad_sync():
            t0 = time.perf_counter()
            inner()
            sync_times.append(time.perf_counter() - t0)

        dp.grad_sync = grad_sync
    updater = PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg),
                            run_facts(cfg, torch.device("cpu")), data_parallel=dp)
    batch = make_batch(args)
    updater.update(batch, torch.Generator().manual_seed(0))  # warm-up
    sync_times.clear()
    update = timed(lambda: updater.update(batch, torch.Generator().manual_seed(0)), args.repeats)
    res = {"update": statistics.median(update), "grad_sync": statistics.median(sync_times) if sync_times else 0.0}
    if ctx is not None:  # sharded generation (torchrun path): each rank generates half the groups
        engine = ctx.wrap_engine(FastEngine(model, tok))
        prompts, counts, seeds = request(args)
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
        engine.generate(prompts, counts, params, seeds)
        res["generate"] = statistics.median(timed(lambda: engine.generate(prompts, counts, params, seeds),
                                                  args.repeats))
    return res


def bench_ddp(args, rows: list[tuple[str, str]]) -> None:
    model, tok = make_model(args)
    prompts, counts, seeds = request(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results[threads] = run_update_bench(args)
        engine = FastEngine(model, tok)
        engine.generate(prompts, counts, params, seeds)
        results[threads]["generate"] = statistics.median(
            timed(lambda e=engine: e.generate(prompts, counts, params, seeds), args.repeats))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.pt")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "init"), out, args, time.time()), nprocs=2, join=True)
        two = torch.load(out, weights_only=False)
    n_rows = sum(counts)
    rows.append(("2 ranks: spawn + process-group start-up", f"{two['startup']:.2f} s"))
    for name, res in (("1 rank, 1 thread", results[1]), ("1 rank, 2 threads", results[2]), ("2 ranks x 1 thread", two)):
        rows.append((f"update ({args.update_rows} rows), {name}",
                     f"{res['update']:.3f} s  (x{results[1]['update'] / res['update']:.2f})"))
    rows.append(("  of which gradient all-reduce per optimiser step (2 ranks)", f"{two['grad_sync'] * 1e3:.1f} ms"))
    for name, res in (("1 rank, 1 thread", results[1]), ("1 rank, 2 threads", results[2]), ("2 ranks x 1 thread", two)):
        rows.append((f"generation, {name}: rollouts/s",
                     f"{n_rows / res['generate']:8.1f}  (x{results[1]['generate'] / res['generate']:.2f})"))


# ------------------------------------------------------------------------------------------------ fsdp


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimiser state (its shards under FSDP2)."""
    from torch.distributed.tensor import DTensor

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    return {
        "params": sum(nbytes(p) for p in model.parameters()),
        "grads": sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer": sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }


def _fsdp_rank(rank: int, world: int, init: str, out: str, args) -> None:
    """Three arms in the same two processes, interleaved per repeat: one process (rank 0 alone, rank 1 waiting),
    DDP on 2 ranks, FSDP2 on 2 ranks; AdamW, the same batch, a barrier before each timed update."""
    from podsrl.distributed import init_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ctx = init_distributed(torch.device("cpu"))
    cfg = load_config(None, [f"optim.micro_batch_size={args.micro}", f"rollout.max_new_tokens={args.max_new_tokens}",
                             "train.strategy=fsdp"])
    arms: dict[str, tuple] = {}
    for name in ("1 process", "ddp, 2 ranks", "fsdp, 2 ranks"):
        if name == "1 process" and rank != 0:
            continue
        model, _ = make_model(args)
        model.train()
        dp = None if name == "1 process" else build_data_parallel(ctx, model, None,
                                                                  cfg if name.startswith("fsdp") else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        updater = PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg),
                                run_facts(cfg, torch.device("cpu")),
                                data_parallel=dp)
        arms[name] = (updater, model, optimizer, dp)
    batch = make_batch(args)
    res: dict = {"memory": {}, "times": {name: [] for name in arms}}
    for name in ("1 process", "ddp, 2 ranks", "fsdp, 2 ranks"):
        ctx.barrier()  # on every rank, so the collectives pair up
        if name not in arms:
            continue
        updater, model, optimizer, dp = arms[name]
        updater.update(batch, torch.Generator().manual_seed(0))  # warm-up; creates gradients and AdamW state
        res["memory"][name] = training_state_bytes(model, optimizer)
        if name.startswith("fsdp"):
            res["memory"]["fsdp generation copy"] = sum(p.numel() * p.element_size()
                                                        for p in dp.generation_model.parameters())
    for _ in range(args.repeats):
        for name in ("1 process", "ddp, 2 ranks", "fsdp, 2 ranks"):
            ctx.barrier()
            if name not in arms:
                continue
            t0 = time.perf_counter()
            arms[name][0].update(batch, torch.Generator().manual_seed(0))
            res["times"][name].append(time.perf_counter() - t0)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def bench_fsdp(args, rows: list[tuple[str, str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.pt")
        mp.spawn(_fsdp_rank, args=(2, os.path.join(tmp, "init"), out, args), nprocs=2, join=True)
        ranks = torch.load(out, weights_only=False)
    one = ranks[0]["memory"]["1 process"]
    rows.append(("per-rank training state (MiB)", "params + grads + AdamW = total  (vs 1 process)"))
    for name in ("1 process", "ddp, 2 ranks", "fsdp, 2 ranks"):
        for r, res in enumerate(ranks):
            if name not in res["memory"]:
                continue
            m = res["memory"][name]
            total = sum(m.values())
            rows.append((f"  {name}, rank {r}", f"{m['params'] / 2**20:.2f} + {m['grads'] / 2**20:.2f} + "
                         f"{m['optimizer'] / 2**20:.2f} = {total / 2**20:.2f}  (x{total / sum(one.values()):.2f})"))
    rows.append(("  fsdp: unsharded generation copy per rank (not in the above)",
                 f"{ranks[0]['memory']['fsdp generation copy'] / 2**20:.2f} MiB"))
    times = ranks[0]["times"]
    for name, ts in times.items():
        rows.append((f"update ({args.update_rows} rows, AdamW), {name}",
                     f"median {statistics.median(ts):.3f} s  (min {min(ts):.3f}, max {max(ts):.3f}, n={len(ts)})"))
    for a, b in (("fsdp, 2 ranks", "ddp, 2 ranks"), ("fsdp, 2 ranks", "1 process")):
        ratios = [x / y for x, y in zip(times[a], times[b])]  # paired: the same repeat, back to back
        rows.append((f"step time {a} / {b}", f"median x{statistics.median(ratios):.2f}  "
                     f"(range x{min(ratios):.2f} to x{max(ratios):.2f} over {len(ratios)} interleaved repeats)"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--update-rows", type=int, default=64)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-ray", action="store_true")
    p.add_argument("--skip-ddp", action="store_true")
    p.add_argument("--skip-fsdp", action="store_true")
    args = p.parse_args()
    model, _ = make_model(args)
    size = count_parameters(model)
    rows: list[tuple[str, str]] = [
        ("model", f"tiny Qwen2, hidden {args.hidden}, {args.layers} layers, {size / 1e6:.2f} M params, "
                  + f"{size * 4 / 2**20:.1f} MiB fp32"),
        ("request", f"{args.prompts} prompts x {args.n} rollouts, up to {args.max_new_tokens} new tokens"),
        ("machine", f"{os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread per rank, "
                    f"load average {os.getloadavg()[0]:.1f} at start"),
    ]
    if not args.skip_ray:
        bench_ray(args, rows)
    if not args.skip_ddp:
        bench_ddp(args, rows)
    if not args.skip_fsdp:
        bench_fsdp(args, rows)
    rows.append(("load average at end", f"{os.getloadavg()[0]:.1f}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
