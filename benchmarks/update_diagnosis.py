"""The study's update on a GPU, in arms that separate what the CPU's launch count cannot see.

The workload is benchmarks/update_ops.py's `Study`: the update of a step of configs/gpu_pods_study.yaml (512 rows of
~20-token completions, micro-batches as optim.micro_batch_size=auto decides them on the device, the
25.2M-parameter model at width 512), then the weight sync into the
fast engine's copy, as the trainer times it as time/update. Arms, interleaved round by round (`--repeats` timed
rounds after one untimed):
  fresh             bfloat16 autocast over float32 masters, a new batch every update (new shapes, as in training)
  same              the same batch every update (every shape seen before)
  cudnn_off         fresh batches with cuDNN's attention off (torch.backends.cuda.enable_cudnn_sdp(False))
  after_generation  a fresh batch right after a step's generation (2,048 rollouts) and the engine's release
  float32           fresh batches with float32 compute (a second model; cuDNN attention is not eligible for it)
Per arm: wall seconds and GPU-event seconds per update, and the CUDA allocator's retries (num_alloc_retries) and
cudaMalloc/cudaFree calls (num_device_alloc/free) summed over its timed updates. Then:
  - a profiler top-15 of one fresh update (by device time on CUDA, by CPU time on the CPU), the summed
    kernel time beside the wall time, and which scaled_dot_product_attention kernels ran;
  - a fresh process with TORCH_CUDNN_SDPA_DEPRIORITIZED=1 (read once per process, at its first attention call),
    timing the fresh and same arms;
  - new attention shapes per update, from `benchmarks/update_shapes.py --device D --steps N --out FILE.json` where
    that script exists ("not present" otherwise).
Everything goes to `--json` as it is measured (benchmarks/speed_results.py).

    python benchmarks/update_diagnosis.py --device cuda --json /tmp/update.json
    python benchmarks/update_diagnosis.py --device cpu --hidden 16 --repeats 1 --shapes-steps 12   # plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.speed_results import DeviceTimer, Results, sync  # noqa: E402
from benchmarks.timing import machine_line  # noqa: E402
from benchmarks.update_ops import Study  # noqa: E402

ARMS = {
    "fresh": "fresh batch (as training)",
    "same": "the same batch again",
    "cudnn_off": "fresh batch, cuDNN attention off",
    "after_generation": "fresh batch after generation + release",
    "float32": "fresh batch, float32 compute",
}
ALLOCATOR_STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free")
# --smoke: the plumbing on a CPU: one layer, 4 prompts x 4 rollouts, float32 (the CPU's bfloat16 is slow)
SMOKE = ("model.tiny.num_layers=1", "rollout.prompts_per_step=4", "rollout.n=4", "pods.m=4", "model.compute_dtype=float32")
SHAPES_SCRIPT = ROOT / "benchmarks/update_shapes.py"
SHAPES_LINE = re.compile(r"^new attention shapes per update after step (\d+): ([\d.]+) \(distinct in all: (\d+)\)",
                         re.MULTILINE)


def time_arms(device: str, hidden: int, repeats: int, arms: list[str], overrides: tuple[str, ...] = ()) -> dict:
    """Per arm: wall and GPU-event seconds of each timed update and the allocator's calls during them."""
    cuda = device.startswith("cuda")
    study = Study(hidden, device, overrides=overrides)
    float32 = Study(hidden, device, compute="float32", overrides=overrides) if "float32" in arms else None
    out = {a: {"label": ARMS[a], "wall_s": [], "gpu_s": [], **dict.fromkeys(ALLOCATOR_STATS, 0)} for a in arms}
    same = study.batch(0)
    for r in range(repeats + 1):
        for i, arm in enumerate(arms[r % len(arms):] + arms[: r % len(arms)]):
            seed = 1 + r * len(arms) + i
            target = float32 if arm == "float32" else study
            batch = same if arm == "same" else target.batch(seed)
            if arm == "after_generation":
                study.generate(seed)
            if cuda:
                torch.backends.cuda.enable_cudnn_sdp(arm != "cudnn_off")
                before = torch.cuda.memory_stats()
            with DeviceTimer(device) as timer:
                target.update(batch, seed)
            if r == 0:
                continue
            out[arm]["wall_s"].append(timer.wall)
            out[arm]["gpu_s"].append(timer.gpu)
            if cuda:
                after = torch.cuda.memory_stats()
                for k in ALLOCATOR_STATS:
                    out[arm][k] += after.get(k, 0) - before.get(k, 0)
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(True)
    for res in out.values():
        res["median_wall_s"] = statistics.median(res["wall_s"])
        res["median_gpu_s"] = statistics.median(res["gpu_s"]) if cuda else None
    return out


def profile_update(device: str, hidden: int, overrides: tuple[str, ...] = (), rows: int = 15) -> dict:
    """One fresh update (after one untimed) under torch.profiler: the top `rows` operations, the kernels'
    summed time beside the wall time, and the attention operations that ran."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    study = Study(hidden, device, overrides=overrides)
    study.update(study.batch(1), 1)
    batch = study.batch(2)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof, DeviceTimer(device) as timer:
        study.update(batch, 2)
        sync(device)
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    # the device's own activities (kernels, copies), not the annotations the profiler mirrors onto its timeline
    kernels_us = sum(e.self_device_time_total for e in events
                     if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    attention = {e.key: e.count for e in events
                 if any(s in e.key for s in ("scaled_dot_product", "flash_attention", "efficient_attention",
                                             "cudnn_attention"))}
    return {"wall_s": timer.wall, "kernels_s": kernels_us / 1e6 if cuda else None, "sorted_by": sort,
            "attention_ops": attention, "top": events.table(sort_by=sort, row_limit=rows)}


def deprioritised_child(opts) -> dict:
    """The fresh and same arms in a fresh process with TORCH_CUDNN_SDPA_DEPRIORITIZED=1."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "child.json"
        cmd = [sys.executable, __file__, "--device", opts.device, "--hidden", str(opts.hidden), "--repeats",
               str(opts.repeats), "--arms", "fresh", "same", "--no-profile", "--no-children", "--json", str(path),
               *(["--smoke"] if opts.smoke else [])]
        env = {**os.environ, "TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=opts.child_timeout)
        except subprocess.TimeoutExpired:
            return {"status": f"timed out at {opts.child_timeout}s"}
        print(run.stdout, end="")
        if run.returncode != 0:
            return {"status": f"failed (exit {run.returncode})", "stderr": run.stderr[-3000:]}
        return {"status": "ok", **json.loads(path.read_text()).get("arms", {})}


def attention_shapes(opts) -> dict:
    """benchmarks/update_shapes.py's count, where the script exists."""
    if not SHAPES_SCRIPT.exists():
        return {"status": "not present"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shapes.json"
        cmd = [sys.executable, str(SHAPES_SCRIPT), "--device", opts.device, "--steps", str(opts.shapes_steps),
               "--warmup", str(min(10, opts.shapes_steps - 1)),
               "--micro-batch", "auto",  # the micro-batch the arms time: the study's default, auto
               "--out", str(path)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.child_timeout)
        except subprocess.TimeoutExpired:
            return {"status": f"timed out at {opts.child_timeout}s"}
        print(run.stdout[-2000:], end="")
        found = SHAPES_LINE.findall(run.stdout)  # the script's final line
        after, new, distinct = found[-1] if found else (None, None, None)
        result = {"status": "ok" if run.returncode == 0 and found else f"failed (exit {run.returncode})",
                  "line": found and f"new attention shapes per update after step {after}: {new} (distinct in all: "
                                    f"{distinct})",
                  "new_per_update": float(new) if found else None, "distinct": int(distinct) if found else None}
        if run.returncode != 0:
            result["stderr"] = run.stderr[-2000:]
        if path.exists():
            result["file"] = json.loads(path.read_text())
        return result


def arm_text(res: dict) -> str:
    gpu = res.get("median_gpu_s")
    return f"{res['median_wall_s'] * 1e3:.1f} ms" + ("" if gpu is None else f" (GPU events {gpu * 1e3:.1f} ms)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=512, help="the model's width (the study's: 512)")
    parser.add_argument("--repeats", type=int, default=4, help="timed rounds after one untimed")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--json", help="the result file (written as it fills)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-children", action="store_true", help="no deprioritised process, no shape count")
    parser.add_argument("--shapes-steps", type=int, default=20, help="steps of benchmarks/update_shapes.py")
    parser.add_argument("--child-timeout", type=int, default=40, help="seconds for each child process")
    parser.add_argument("--smoke", action="store_true", help="the plumbing on a CPU: one layer, 16 rows, float32")
    opts = parser.parse_args(argv)
    print(machine_line(device=opts.device), flush=True)
    if opts.device.startswith("cuda"):
        print(f"cuDNN {torch.backends.cudnn.version()}, TORCH_CUDNN_SDPA_DEPRIORITIZED="
              f"{os.environ.get('TORCH_CUDNN_SDPA_DEPRIORITIZED', 'unset')}", flush=True)
    results = Results(opts.json, "update diagnosis")
    results.put("setup", {"device": opts.device, "hidden": opts.hidden, "repeats": opts.repeats,
                          "cudnn": torch.backends.cudnn.version() if opts.device.startswith("cuda") else None})
    overrides = SMOKE if opts.smoke else ()
    arms = time_arms(opts.device, opts.hidden, opts.repeats, opts.arms, overrides)
    results.put("arms", arms)
    print(f"\n== the update at width {opts.hidden} on {opts.device}, {opts.repeats} interleaved rounds; median")
    for res in arms.values():
        alloc = ", ".join(f"{k} {res[k]}" for k in ALLOCATOR_STATS)
        print(f"  {res['label']:<42}{arm_text(res)}  {alloc}", flush=True)
    line = "; ".join(f"{name} {arm_text(res)}" for name, res in arms.items())
    results.summary(f"update at width {opts.hidden}: {line}")
    if not opts.no_profile:
        prof = profile_update(opts.device, opts.hidden, overrides)
        results.put("profile", prof)
        kernels = "" if prof["kernels_s"] is None else f", kernels {prof['kernels_s'] * 1e3:.1f} ms"
        print(f"\n== profile of one fresh update: wall {prof['wall_s'] * 1e3:.1f} ms{kernels}; attention "
              f"ops {prof['attention_ops']}\n{prof['top']}", flush=True)
        line += f"; profiled wall {prof['wall_s'] * 1e3:.1f} ms{kernels}"
    if not opts.no_children:
        child = deprioritised_child(opts)
        results.put("deprioritised_process", child)
        if child["status"] == "ok":
            line += "; TORCH_CUDNN_SDPA_DEPRIORITIZED=1: " + ", ".join(
                f"{a} {arm_text(child[a])}" for a in ("fresh", "same"))
        else:
            line += f"; deprioritised process {child['status']}"
        shapes = attention_shapes(opts)
        results.put("attention_shapes", shapes)
        line += f"; attention shapes: {shapes.get('line') or shapes['status']}"
        print(f"\n== attention shapes: {shapes.get('line') or shapes['status']}", flush=True)
    results.summary(f"update at width {opts.hidden}: {line}")


if __name__ == "__main__":
    main()
