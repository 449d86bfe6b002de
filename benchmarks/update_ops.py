"""The update's kernel launches and host syncs, per phase, counted on the CPU; and its CPU time.

The workload is the update of a step of configs/gpu_pods_study.yaml (the 25.2M-parameter built-in model's study): 32
prompts of the arithmetic task with worked solutions (at most 12 characters), 16 kept rollouts each (512 rows),
completions of 10-35 characters + EOS, micro-batches of 256 (optim.micro_batch_size's default), mixed precision
(float32 masters, bfloat16 autocast) and the rollout correction that precision-only mismatch gets (token_tis), then
the weight sync into the fast engine's bfloat16 sampling copy, as `Trainer.train_step` times them as time/update.
The model keeps the study's op structure (8 layers, 8 heads, the rows and micro-batches) at a width of `--hidden`
(default 64 instead of 512) so the CPU's arithmetic stays small; launches and syncs do not depend on the width.

Counts (benchmarks/device_ops.py) are of one update after one warm-up update, per phase: the plan (index work on
host tensors), forward, backward, loss and metrics, gradient clipping, the optimiser step and the weight sync.
Attention is counted as CUDA runs it (scaled_dot_product_attention; on the CPU podsrl runs it as matmuls). Two CPU
artefacts are left in the counts and said as such: on the CPU clip_grad_norm_ runs one norm and one multiply per
parameter (CUDA: a few foreach kernels) and the fused AdamW is one call (CUDA: a few multi-tensor launches).

Time: median and [min-max] of `--repeats` timed updates (after one untimed), float32 masters with bfloat16 compute
on the CPU, one torch thread. With `--baseline REV` the same counts and times are taken of podsrl at git revision
REV (extracted to a temporary directory) in child processes, the two arms interleaved round by round.

    python benchmarks/update_ops.py [--hidden 64] [--repeats 5] [--baseline REV]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.device_ops import DeviceOps  # noqa: E402
from benchmarks.timing import Spread, machine_line  # noqa: E402

CONFIG = ROOT / "configs/gpu_pods_study.yaml"
PROMPTS, KEPT = 32, 16  # PODS 64 -> 16 over 32 prompts
PHASES = ("plan", "forward", "backward", "loss and metrics", "clip", "optimiser", "weight sync")


def workload(hidden: int, overrides: list[str] = (), seed: int = 0):
    """(updater, engine, batch) of the study's update at width `hidden`; `seed` draws the model, the prompts (the
    task's problems seed x 32 on) and the completions."""
    from podsrl.batch import Problem, RolloutBatch
    from podsrl.build import rollout_engine
    from podsrl.config import load_config
    from podsrl.methods import METHODS
    from podsrl.models.loading import build_char_tokenizer, build_tiny_model
    from podsrl.run.facts import run_facts
    from podsrl.tasks import build_task
    from podsrl.update import PolicyUpdater
    from podsrl.update.optimizer import build_optimizer

    cfg = load_config(CONFIG, ["model.device=cpu", "model.compute_dtype=bfloat16", f"model.tiny.hidden_size={hidden}",
                               f"model.tiny.intermediate_size={3 * hidden}", *overrides])
    facts = run_facts(cfg, torch.device("cpu"))
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg.model.tiny, tokenizer, seed=seed)
    optimizer, scheduler = build_optimizer(cfg, model, sharded=False)
    updater = PolicyUpdater(model, optimizer, scheduler, cfg, facts, modulation=METHODS[cfg.method](cfg).token_modulation())
    engine = rollout_engine(cfg, model, tokenizer)
    task = build_task(cfg.task, tokenizer)
    prompts = [tokenizer(task.problem(seed * PROMPTS + i).prompt)["input_ids"] for i in range(PROMPTS)]
    gen = torch.Generator().manual_seed(seed)
    symbols = tokenizer.convert_tokens_to_ids(list("0123456789+=,;"))
    rows, width, longest = PROMPTS * KEPT, cfg.rollout.max_new_tokens, max(map(len, prompts))
    prompt_ids = torch.full((rows, longest), tokenizer.pad_token_id)
    prompt_mask = torch.zeros(rows, longest, dtype=torch.long)
    completion_ids = torch.full((rows, width), tokenizer.pad_token_id)
    completion_mask = torch.zeros(rows, width)
    for r in range(rows):
        p = prompts[r // KEPT]
        prompt_ids[r, longest - len(p):] = torch.tensor(p)
        prompt_mask[r, longest - len(p):] = 1
        length = int(torch.randint(10, 36, (1,), generator=gen))
        tokens = torch.tensor(symbols)[torch.randint(0, len(symbols), (length,), generator=gen)]
        completion_ids[r, :length + 1] = torch.cat([tokens, torch.tensor([tokenizer.eos_token_id])])
        completion_mask[r, :length + 1] = 1
    batch = RolloutBatch(
        problems=[Problem(uid=str(i), prompt="", answer="") for i in range(PROMPTS)],
        group_index=torch.arange(PROMPTS).repeat_interleave(KEPT), prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        completion_ids=completion_ids, completion_mask=completion_mask, truncated=torch.zeros(rows, dtype=torch.bool),
        advantages=torch.randn(rows, generator=gen),
        sampler_logprobs=-torch.rand(rows, width, generator=gen) * completion_mask)
    return updater, engine, batch.trim_padding()


def timed_update(updater, engine, batch, seed: int) -> None:
    """What time/update times: the update, freeing the gradients, the engine's weight sync."""
    updater.update(batch, torch.Generator().manual_seed(seed))
    updater.optimizer.zero_grad(set_to_none=True)
    engine.sync_weights(updater.model)


@contextlib.contextmanager
def phases(ops: DeviceOps, updater, engine):
    """Each phase's calls run inside `ops.phase(name)` (the functions are wrapped while open)."""
    import podsrl.update.shared_prompt as shared_prompt
    from podsrl.models.packed import PackedForward

    def wrap(owner, attribute: str, name: str):
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            with ops.phase(name):
                return original(*args, **kwargs)

        return owner, attribute, original, wrapped

    targets = [wrap(shared_prompt, "build_plan", "plan"), wrap(PackedForward, "__call__", "forward"),
               wrap(torch.Tensor, "backward", "backward"), wrap(torch.nn.utils, "clip_grad_norm_", "clip"),
               wrap(updater.optimizer, "step", "optimiser"), wrap(engine, "sync_weights", "weight sync")]
    try:
        for owner, attribute, _, wrapped in targets:
            setattr(owner, attribute, wrapped)
        with ops.phase("loss and metrics"):
            yield
    finally:
        for owner, attribute, original, _ in targets:
            setattr(owner, attribute, original)


def count(updater, engine, batch, next_batch) -> dict:
    """Launches, syncs and transfers per phase of one update (after a warm-up one), attention as on CUDA; and how
    many of the next step's matmul and attention shapes (another batch of the same workload) this one had."""
    import podsrl.models.packed_layout as packed_layout
    from podsrl.models.attention import fused_attention

    timed_update(updater, engine, batch, 0)
    state = [t for s in updater.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    device_tensors = [*updater.model.parameters(), *updater.model.buffers(), *engine.model.parameters(),
                      *engine.model.buffers(), *state]
    original, packed_layout.grouped_attention = packed_layout.grouped_attention, fused_attention
    try:
        with DeviceOps(device_tensors) as ops, phases(ops, updater, engine):
            timed_update(updater, engine, batch, 1)
        with DeviceOps(device_tensors) as following:
            timed_update(updater, engine, next_batch, 2)
    finally:
        packed_layout.grouped_attention = original
    return {"dispatches": dict(ops.dispatches), "launches": dict(ops.launches), "syncs": dict(ops.syncs),
            "transfers": dict(ops.transfers),
            "sync_sites": {f"{p}: {n}": c for (p, n), c in ops.sync_names.items()},
            "shapes": len(following.shapes), "new_shapes": len(following.shapes - ops.shapes)}


def times(updater, engine, batch, repeats: int) -> list[float]:
    out = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        timed_update(updater, engine, batch, r)
        if r > 0:
            out.append(time.perf_counter() - t0)
    return out


def arm(hidden: int, repeats: int, with_counts: bool) -> dict:
    updater, engine, batch = workload(hidden)
    result = {"rows": batch.num_rollouts, "micro_batches": -(-batch.num_rollouts // updater.cfg.optim.micro_batch_size),
              "correction": updater.rollout_correction, "times": times(updater, engine, batch, repeats)}
    if with_counts:
        result.update(count(updater, engine, batch, workload(hidden, seed=1)[2]))
    return result


def child(source: Path, hidden: int, repeats: int, with_counts: bool) -> dict:
    """One arm in a fresh process, with podsrl from `source`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", str(int(with_counts)), "--source", str(source),
                          "--hidden", str(hidden), "--repeats", str(repeats)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"arm at {source} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(name: str, res: dict) -> None:
    dispatches, launches, syncs, transfers = res["dispatches"], res["launches"], res["syncs"], res["transfers"]
    print(f"\n== {name}: {res['rows']} rows, {res['micro_batches']} micro-batches, rollout correction "
          f"{res['correction']}")
    print(f"  {'phase':<18}{'dispatches':>12}{'launches':>10}{'syncs':>8}{'transfers':>11}")
    for phase in (*PHASES, "other"):
        if phase in dispatches or phase in syncs or phase in transfers:
            print(f"  {phase:<18}{dispatches.get(phase, 0):>12}{launches.get(phase, 0):>10}{syncs.get(phase, 0):>8}"
                  f"{transfers.get(phase, 0):>11}")
    total = sum(launches.values())
    print(f"  {'total':<18}{sum(dispatches.values()):>12}{total:>10}{sum(syncs.values()):>8}"
          f"{sum(transfers.values()):>11}")
    print(f"  at 5-20 us a launch: {total * 5e-3:.0f}-{total * 20e-3:.0f} ms of launch-bound GPU time")
    print(f"  matmul and attention shapes of the next step's update (another batch): {res['shapes']}, of which "
          f"{res['new_shapes']} this update did not have")
    print("  syncs by site: " + ", ".join(f"{k} {v}" for k, v in sorted(res["sync_sites"].items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="a git revision to compare with (its podsrl, interleaved arms)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if opts.child is not None:
        sys.path.insert(0, opts.source)  # this arm's podsrl, before any is imported
        print(json.dumps(arm(opts.hidden, opts.repeats, opts.child == "1")))
        return
    print(machine_line())
    if opts.baseline is None:
        res = arm(opts.hidden, opts.repeats, True)
        report("this tree", res)
        print(f"  CPU time per update: {Spread.of(res['times']).text(digits=3, unit=' s')}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", opts.baseline, "podsrl"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        arms = {f"baseline {opts.baseline}": old, "this tree": ROOT}
        results = {k: child(src, opts.hidden, 0, True) for k, src in arms.items()}
        runs: dict[str, list[float]] = {k: [] for k in arms}
        for r in range(opts.repeats):  # one timed update per arm and round (after one untimed), order alternating
            for k in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                runs[k] += child(arms[k], opts.hidden, 1, False)["times"]
    for k, res in results.items():
        report(k, res)
    print(f"\n== CPU time per update ({opts.repeats} interleaved rounds, a fresh process per arm and round, "
          f"one untimed update first)")
    for k, t in runs.items():
        print(f"  {k:<24}{Spread.of(t).text(digits=3, unit=' s')}")
    ratios = [a / b for a, b in zip(*runs.values())]
    print(f"  baseline / this tree: median {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}x]")
    print(f"end {machine_line()}")


if __name__ == "__main__":
    main()
