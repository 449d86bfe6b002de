"""The update's kernel launches and host syncs, per phase, counted on the CPU; and its CPU time.

The workload is the update of a step of configs/gpu_pods_study.yaml (the 25.2M-parameter built-in model's study): 32
prompts of the arithmetic task with worked solutions (at most 12 characters), 16 kept rollouts each (512 rows),
completions of 10-35 characters + EOS, micro-batches of 256 (by default: two, what optim.micro_batch_size=auto is on the CPU; `--micro-batch
ROWS` sets it, `--micro-batch auto` as optim.micro_batch_size=auto decides it on a CUDA device of `--device-gib`
GiB, default 139, an H200: one micro-batch of all 512 rows), mixed precision
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

    python benchmarks/update_ops.py [--hidden 64] [--repeats 5] [--micro-batch ROWS|auto] [--baseline REV]
    python benchmarks/update_ops.py --diagnose cuda [--repeats 5]

`--diagnose DEVICE` runs benchmarks/update_diagnosis.py's arms on DEVICE (for a GPU: the update at the study's width
in arms that separate per-shape set-up, cuDNN attention, the engine's release and precision, and a profile of one
update; benchmarks/gpu_speed.sh runs the whole diagnosis, its fresh processes too).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
H200_GIB = 139.0  # an H200's memory as torch reports it
PHASES = ("plan", "forward", "backward", "loss and metrics", "clip", "optimiser", "weight sync")


class Study:
    """The study's update at width `hidden` on `device` (autocast to `compute` over float32 masters): its updater,
    the fast engine over the policy, and batches (`batch(seed)`: the task's problems seed x P on, P the config's
    rollout.prompts_per_step (32), pods.m (16) completions each); `overrides` go to the study's config last. The
    study's optim.micro_batch_size=auto is decided as a run on CUDA would: on this CUDA device, or off CUDA on one of
    `device_gib` GiB (`micro_why` says how; "set" when the config sets it)."""

    def __init__(self, hidden: int, device: str = "cpu", seed: int = 0, compute: str = "bfloat16",
                 overrides: tuple[str, ...] = (), device_gib: float = H200_GIB) -> None:
        from podsrl.build import rollout_engine
        from podsrl.config import load_config
        from podsrl.config.facts import run_facts
        from podsrl.methods import METHODS
        from podsrl.models.loading import build_char_tokenizer, build_tiny_model
        from podsrl.tasks import build_task
        from podsrl.update import PolicyUpdater, UpdateSettings
        from podsrl.update.optimizer import build_optimizer

        self.cfg = cfg = load_config(CONFIG, [f"model.device={device}", f"model.compute_dtype={compute}",
                                              f"model.tiny.hidden_size={hidden}",
                                              f"model.tiny.intermediate_size={3 * hidden}", *overrides])
        self.micro_why = "set"
        if cfg.optim.micro_batch_size == 0:
            if device.startswith("cuda"):
                device_gib = torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30
            rows, self.micro_why = study_micro_batch(device_gib)
            self.cfg = cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, micro_batch_size=rows))
        self.tokenizer = build_char_tokenizer()
        model = build_tiny_model(cfg.model.tiny, self.tokenizer, seed=seed).to(device)
        optimizer, scheduler = build_optimizer(cfg, model, sharded=False)
        self.updater = PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg),
                                     run_facts(cfg, torch.device(device)),
                                     modulation=METHODS[cfg.method](cfg).token_modulation())
        self.engine = rollout_engine(cfg, model, self.tokenizer, run_facts(cfg, torch.device(device)).compute_dtype)
        self.task = build_task(cfg.task, self.tokenizer)

    def prompts(self, seed: int) -> list[list[int]]:
        prompts = self.cfg.rollout.prompts_per_step
        return [self.tokenizer(self.task.problem(seed * prompts + i).prompt)["input_ids"] for i in range(prompts)]

    def batch(self, seed: int):
        from podsrl.batch import Problem, RolloutBatch

        tokenizer, prompts, gen = self.tokenizer, self.prompts(seed), torch.Generator().manual_seed(seed)
        symbols = tokenizer.convert_tokens_to_ids(list("0123456789+=,;"))
        groups, kept = len(prompts), self.cfg.pods.m  # PODS n -> m: m rows trained per prompt
        rows, width, longest = groups * kept, self.cfg.rollout.max_new_tokens, max(map(len, prompts))
        prompt_ids = torch.full((rows, longest), tokenizer.pad_token_id)
        prompt_mask = torch.zeros(rows, longest, dtype=torch.long)
        completion_ids = torch.full((rows, width), tokenizer.pad_token_id)
        completion_mask = torch.zeros(rows, width)
        for r in range(rows):
            p = prompts[r // kept]
            prompt_ids[r, longest - len(p):] = torch.tensor(p)
            prompt_mask[r, longest - len(p):] = 1
            length = int(torch.randint(10, 36, (1,), generator=gen))
            tokens = torch.tensor(symbols)[torch.randint(0, len(symbols), (length,), generator=gen)]
            completion_ids[r, :length + 1] = torch.cat([tokens, torch.tensor([tokenizer.eos_token_id])])
            completion_mask[r, :length + 1] = 1
        batch = RolloutBatch(
            problems=[Problem(uid=str(i), prompt="", answer="") for i in range(groups)],
            group_index=torch.arange(groups).repeat_interleave(kept), prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            completion_ids=completion_ids, completion_mask=completion_mask,
            truncated=torch.zeros(rows, dtype=torch.bool), advantages=torch.randn(rows, generator=gen),
            sampler_logprobs=-torch.rand(rows, width, generator=gen) * completion_mask)
        return batch.trim_padding()

    def update(self, batch, seed: int) -> None:
        """What time/update times: the update, freeing the gradients, the engine's weight sync."""
        self.updater.update(batch, torch.Generator().manual_seed(seed))
        self.updater.optimizer.zero_grad(set_to_none=True)
        self.engine.sync_weights(self.updater.model)

    def generate(self, seed: int) -> None:
        """A step's generation before its update, as the trainer runs it: rollout.n (64) rollouts of each prompt,
        then the engine's release of its state (and CUDA graphs)."""
        from podsrl.engines.base import SamplingParams

        params = SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=1.0)
        prompts = self.cfg.rollout.prompts_per_step
        self.engine.generate(self.prompts(seed), [self.cfg.rollout.n] * prompts, params,
                             torch.arange(prompts * self.cfg.rollout.n) + seed * 10_000)
        self.engine.release()


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


def count(study: Study, batch, next_batch) -> dict:
    """Launches, syncs and transfers per phase of one update (after a warm-up one), attention as on CUDA; and how
    many of the next step's matmul and attention shapes (another batch of the same workload) this one had."""
    import podsrl.models.packed_layout as packed_layout

    updater, engine = study.updater, study.engine
    study.update(batch, 0)
    state = [t for s in updater.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    device_tensors = [*updater.model.parameters(), *updater.model.buffers(), *engine.model.parameters(),
                      *engine.model.buffers(), *state]
    original, packed_layout.block_attend = packed_layout.block_attend, packed_layout.sdpa_block_attend
    try:
        with DeviceOps(device_tensors) as ops, phases(ops, updater, engine):
            study.update(batch, 1)
        with DeviceOps(device_tensors) as following:
            study.update(next_batch, 2)
    finally:
        packed_layout.block_attend = original
    return {"dispatches": dict(ops.dispatches), "launches": dict(ops.launches), "syncs": dict(ops.syncs),
            "transfers": dict(ops.transfers),
            "sync_sites": {f"{p}: {n}": c for (p, n), c in ops.sync_names.items()},
            "shapes": len(following.shapes), "new_shapes": len(following.shapes - ops.shapes)}


def times(study: Study, batch, repeats: int) -> list[float]:
    out = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        study.update(batch, r)
        if r > 0:
            out.append(time.perf_counter() - t0)
    return out


def study_micro_batch(device_gib: float) -> tuple[int, str]:
    """(rows, why): optim.micro_batch_size=auto as a run of the study (at its own width) decides it at start-up on
    a CUDA device of `device_gib` GiB (podsrl/run/micro_batch.py)."""
    from podsrl.config import load_config
    from podsrl.memory_plan import auto_micro_batch, transformers_config
    from podsrl.models.loading import build_char_tokenizer
    from podsrl.tasks import build_task
    from podsrl.tasks.prompt_length import longest_prompt

    cfg = load_config(CONFIG)
    prompt = cfg.task.max_prompt_length or longest_prompt(build_task(cfg.task, build_char_tokenizer()),
                                                          build_char_tokenizer())
    return auto_micro_batch(cfg, transformers_config(cfg, "tiny"), prompt, "cuda", 1, int(device_gib * 2**30))


def arm(hidden: int, repeats: int, with_counts: bool, micro_batch: int | None) -> dict:
    study = Study(hidden, overrides=(f"optim.micro_batch_size={micro_batch}",) if micro_batch else ())
    batch, updater = study.batch(0), study.updater
    result = {"rows": batch.num_rollouts, "micro_batches": -(-batch.num_rollouts // updater.cfg.optim.micro_batch_size),
              "correction": updater.rollout_correction, "times": times(study, batch, repeats)}
    if with_counts:
        result.update(count(study, batch, study.batch(1)))
    return result


def child(source: Path, hidden: int, repeats: int, with_counts: bool, micro_batch: int | None) -> dict:
    """One arm in a fresh process, with podsrl from `source`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", str(int(with_counts)), "--source", str(source),
                          "--hidden", str(hidden), "--repeats", str(repeats),
                          *(["--micro-batch", str(micro_batch)] if micro_batch else [])],
                         capture_output=True, text=True, env=env)
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
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="a git revision to compare with (its podsrl, interleaved arms)")
    parser.add_argument("--diagnose", metavar="DEVICE",
                        help="benchmarks/update_diagnosis.py on DEVICE (cuda: the study's width 512 unless --hidden): "
                             "the arms that separate what the count cannot (shape reuse, cuDNN attention, the "
                             "engine's release, precision)")
    parser.add_argument("--micro-batch", help="optim.micro_batch_size: rows, or auto as the memory plan decides it "
                        "on a CUDA device of --device-gib (default 256: what auto is on the CPU, the rows of the figures "
                        "quoted before auto became the default)", default="256")
    parser.add_argument("--device-gib", type=float, default=H200_GIB,
                        help="the CUDA device's memory for the study's auto micro-batch (default: an H200's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    opts.hidden_given, opts.hidden = opts.hidden is not None, opts.hidden or 64
    torch.set_num_threads(1)
    if opts.child is not None:
        sys.path.insert(0, opts.source)  # this arm's podsrl, before any is imported
        print(json.dumps(arm(opts.hidden, opts.repeats, opts.child == "1",
                             int(opts.micro_batch) if opts.micro_batch else None)))
        return
    if opts.diagnose:
        from benchmarks.update_diagnosis import main as diagnose

        hidden = opts.hidden if opts.hidden_given or not opts.diagnose.startswith("cuda") else 512
        diagnose(["--device", opts.diagnose, "--hidden", str(hidden), "--repeats", str(opts.repeats), "--no-children"])
        return
    print(machine_line())
    micro = opts.micro_batch
    if micro == "auto":  # decided here: a baseline's podsrl may not know auto
        micro, why = study_micro_batch(opts.device_gib)
        print(f"micro-batch: {micro} rows (optim.micro_batch_size=auto on a CUDA device of {opts.device_gib:g} GiB: "
              f"{why})")
    elif micro is not None:
        micro = int(micro)
    if opts.baseline is None:
        res = arm(opts.hidden, opts.repeats, True, micro)
        report("this tree", res)
        print(f"  CPU time per update: {Spread.of(res['times']).text(digits=3, unit=' s')}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", opts.baseline, "podsrl"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        arms = {f"baseline {opts.baseline}": old, "this tree": ROOT}
        results = {k: child(src, opts.hidden, 0, True, micro) for k, src in arms.items()}
        runs: dict[str, list[float]] = {k: [] for k in arms}
        for r in range(opts.repeats):  # one timed update per arm and round (after one untimed), order alternating
            for k in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                runs[k] += child(arms[k], opts.hidden, 1, False, micro)["times"]
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
