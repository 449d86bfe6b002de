"""How many new attention shapes each update of the study brings: what a per-shape backend (cuDNN's SDPA plans,
built per new shape on CUDA in bfloat16) would set up again, counted on any device.

`--steps` updates of configs/gpu_pods_study.yaml's workload (benchmarks/update_ops.py's `Study`: 32 prompts of the
arithmetic task, 16 kept rollouts each, completions of 10-35 tokens + EOS, micro-batches of 256, `--micro-batch
ROWS|auto` to change them; a new batch each step) at width `--hidden`, float32 on the CPU, and one layer (the shapes depend on none of these: every layer issues
the same calls, and the heads stay the study's). Each update's micro-batches run their forward as the update does
(the backward repeats the forward's attention shapes, so it is left out to keep the run short). Attention runs as
on CUDA (scaled_dot_product_attention with a bool mask, packed_layout.sdpa_block_attend), and each call's (query,
key, mask) shapes are recorded. `--ladder on` lays the update out as CUDA does (podsrl/models/shape_ladder.py: block
sizes rounded up to a fixed ladder), `off` as the CPU does (exact sizes). The last line is the mean number of
shapes an update brings that no earlier update had, over the updates after `--warmup`, and the distinct shapes of
the whole run.

    python benchmarks/update_shapes.py [--steps 50] [--ladder on|off] [--hidden 16] [--device cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.timing import machine_line  # noqa: E402
from benchmarks.update_ops import Study  # noqa: E402


def shapes_per_update(steps: int, ladder: bool, hidden: int = 16, device: str = "cpu",
                      micro_batch: str = "256") -> list[set[tuple]]:
    """The attention shapes of each of `steps` updates' forwards (a new batch each)."""
    import podsrl.models.packed_layout as packed_layout

    # bfloat16 as the study runs on CUDA; float32 on the CPU (no fast bfloat16 matmul there; shapes are the same)
    study = Study(hidden, device, compute="bfloat16" if device.startswith("cuda") else "float32",
                  overrides=("model.tiny.num_layers=1",
                             f"optim.micro_batch_size={micro_batch}"))
    updater = study.updater
    for shared in study.updater.shared.values():
        shared.ladder = ladder
    seen: list[set[tuple]] = []

    def recorded(q, keys, values, blocked, allowed, scaling):
        seen[-1].add((tuple(q.shape), tuple(keys.shape), tuple(allowed.shape)))
        return packed_layout.sdpa_block_attend(q, keys, values, blocked, allowed, scaling)

    original, packed_layout.block_attend = packed_layout.block_attend, recorded
    try:
        for step in range(steps):
            seen.append(set())
            batch = study.batch(step)
            with torch.no_grad():
                for rows in updater._micro_batches(batch, torch.arange(batch.num_rollouts)):
                    updater._forward(updater.model, batch, rows)
    finally:
        packed_layout.block_attend = original
    return seen


def study_micro(micro_batch: str) -> str:
    """The micro-batch's rows as `Study` sets them (auto: as a run on an H200 decides it)."""
    if micro_batch != "auto":
        return micro_batch
    from benchmarks.update_ops import H200_GIB, study_micro_batch

    return f"auto: {study_micro_batch(H200_GIB)[0]} rows, as on an H200"


def new_per_update(seen: list[set[tuple]]) -> list[int]:
    """For each update, how many of its shapes no earlier update had."""
    known: set[tuple] = set()
    out = []
    for shapes in seen:
        out.append(len(shapes - known))
        known |= shapes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10, help="updates before the ones averaged")
    parser.add_argument("--ladder", choices=("on", "off"), default="on", help="on: the layout CUDA runs")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--micro-batch", help="optim.micro_batch_size: rows, or auto as a run decides it on CUDA "
                        "(off CUDA: on an H200's 139 GiB; default 256: what auto is on the CPU, the rows of the "
                        "figures quoted before auto became the default)", default="256")
    parser.add_argument("--out", help="a JSON file for the per-update counts")
    opts = parser.parse_args()
    if opts.steps <= opts.warmup:
        print(f"--steps ({opts.steps}) must be more than --warmup ({opts.warmup})", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)
    print(machine_line())
    seen = shapes_per_update(opts.steps, opts.ladder == "on", opts.hidden, opts.device, opts.micro_batch)
    new = new_per_update(seen)
    after = new[opts.warmup:]
    distinct = len(set().union(*seen))
    print(f"ladder {opts.ladder}, {opts.steps} updates at hidden {opts.hidden} on {opts.device}, "
          f"optim.micro_batch_size={study_micro(opts.micro_batch)}")
    print("new attention shapes per update: " + " ".join(map(str, new)))
    print(f"attention shapes per update: {min(map(len, seen))}-{max(map(len, seen))}")
    if opts.out:
        Path(opts.out).write_text(json.dumps({"ladder": opts.ladder, "per_update": new, "distinct": distinct,
                                              "shapes": sorted(map(str, set().union(*seen)))}, indent=1))
    print(f"new attention shapes per update after step {opts.warmup}: {sum(after) / len(after):.2f} "
          f"(distinct in all: {distinct})")


if __name__ == "__main__":
    main()
