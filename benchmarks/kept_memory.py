"""What the fast engine keeps on a CUDA device between generate calls, by allocation site: the check behind
tests/engines/test_waves.py's kept-state test, which compares the allocator's count with the plan's.

A one-row call then `release` sets the baseline; an eval-sized call (24 rows) and a training-sized one (8 rows) with
max_rows 8 follow; then each live block above the baseline is listed with the Python frames that allocated it,
before and after dropping cuBLAS's per-stream workspaces, and after `release`. Two arms in one process: the capture
stream as shipped (one per device: podsrl/engines/decode_step.py capture_stream) and a fresh stream per capture.

    python benchmarks/kept_memory.py            # on a GPU (about 20 s)
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_generation import build_model
from podsrl.engines import decode_step
from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine

MIB = 2**20


def live_blocks() -> dict[int, dict]:
    """The allocator's live blocks by address."""
    blocks = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                blocks[block["address"]] = block
    return blocks


def site(block: dict) -> str:
    """The innermost frames of podsrl or the benchmark that allocated the block."""
    frames = [f for f in block.get("frames", []) if "podsrl" in f["filename"] or "benchmarks" in f["filename"]]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames[:3]) or "(C++)"


def report(label: str, baseline: dict[int, dict], base_bytes: int) -> None:
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base_bytes
    by_site: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for address, block in live_blocks().items():
        if address not in baseline or baseline[address]["size"] != block["size"]:
            by_site[site(block)] += block["size"]
            count[site(block)] += 1
    print(f"  {label}: {held / MIB:.2f} MiB above the baseline")
    for where, size in by_site.most_common(8):
        print(f"    {size / MIB:9.3f} MiB in {count[where]:3d} blocks  {where}")


def arm(model, fresh_streams: bool) -> None:
    if fresh_streams:
        decode_step.capture_stream = lambda: torch.cuda.Stream()
    engine = FastEngine(model, None, eos_token_id=1, pad_token_id=0, max_rows=8)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, model.config.vocab_size, (length,), generator=gen).tolist()
               for length in (31, 3, 5, 6, 2, 4)]
    params = SamplingParams(max_new_tokens=9, temperature=1.0)
    engine.generate(prompts[:1], [1], params, torch.arange(1))
    engine.release()
    torch.cuda.synchronize()
    baseline, base_bytes = live_blocks(), torch.cuda.memory_allocated()
    engine.generate(prompts, [4] * 6, params, torch.arange(24))
    engine.generate(prompts[:2], [4, 4], params, torch.arange(8) + 100)
    print(f"{'a fresh stream per capture' if fresh_streams else 'one capture stream'}: "
          f"{len(engine.runner.graphs.graphs)} graphs kept")
    report("after an eval call and a training call", baseline, base_bytes)
    torch._C._cuda_clearCublasWorkspaces()
    report("after dropping cuBLAS workspaces", baseline, base_bytes)
    engine.release()
    report("after release", baseline, base_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a shape of benchmarks/gpu_generation.py MODELS")
    args = parser.parse_args()
    torch.cuda.memory._record_memory_history(stacks="python")
    model, _, _ = build_model(args.model, "cuda", torch.float32)
    shipped = decode_step.capture_stream
    arm(model, fresh_streams=False)
    torch._C._cuda_clearCublasWorkspaces()
    arm(model, fresh_streams=True)
    decode_step.capture_stream = shipped


if __name__ == "__main__":
    main()
