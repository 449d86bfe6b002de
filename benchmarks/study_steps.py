"""Training steps of the PODS-vs-GRPO study's config (configs/gpu_pods_study.yaml: PODS 64->16 over 32 prompts, the
25.2M-parameter model) in fresh processes, one per arm:
  preferred      torch's default: on sm90 with cuDNN >= 9.15 scaled_dot_product_attention prefers cuDNN
  deprioritised  TORCH_CUDNN_SDPA_DEPRIORITIZED=1 (torch reads it once per process)
Per step, as the trainer logs them: time/update, time/generate, time/step, the tokens trained, and the CUDA-graph
captures the step made with their seconds (benchmarks/speed_results.py CaptureCounter). Each arm takes one first step
(reported apart: it pays the process's first kernels and captures) and then `--steps` steps; the medians are over
those. The study's warm-up runs first in its own process and is cached under `--runs` for both arms (as `podsrl
compare` shares it). Results go to `--json` as each process ends; the target "study update" is the preferred arm's
median time/update.

    python benchmarks/study_steps.py --json /tmp/train.json                     # on a GPU: 15 steps per arm
    python benchmarks/study_steps.py --smoke --steps 2 --json /tmp/train.json   # on a CPU: tiny sizes, the plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.speed_results import CaptureCounter, Results  # noqa: E402

PRESET = ROOT / "configs/gpu_pods_study.yaml"
ARMS = {"preferred": {}, "deprioritised": {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}}
SMOKE = ["model.device=cpu", "model.tiny.num_layers=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "warmup.steps=4", "warmup.batch_size=8", "warmup.validation_size=8", "task.eval_size=8", "eval.samples=0",
         "rollout.prompts_per_step=2", "rollout.max_new_tokens=12", "rollout.n=4", "pods.m=2"]
KEYS = ("time/update", "time/generate", "time/step", "tokens/trained", "tokens/generated")


def overrides(opts) -> list[str]:
    """What the warm-up and both arms run with (the same, so the arms find the warm-up under its cache key)."""
    return [f"warmup.cache_dir={opts.runs}/warmup", "log.progress=false", "log.tensorboard=false", "log.plot=false",
            *(SMOKE if opts.smoke else [])]


def run_steps(opts) -> dict:
    """In this process: the trainer from the cached warm-up, one first step, then `opts.steps` steps."""
    from podsrl.config import load_config
    from podsrl.run.trainer import Trainer

    out_dir = tempfile.mkdtemp(prefix="study_steps_", dir=opts.runs)
    trainer = Trainer(load_config(str(PRESET), [f"output_dir={out_dir}", *overrides(opts)]))
    steps = []
    with CaptureCounter() as captures:
        for _ in range(opts.steps + 1):
            before = captures.count
            metrics = trainer.train_step().metrics
            count, seconds = captures.since(before)
            steps.append({**{k: metrics[k] for k in KEYS}, "captures": count, "capture_s": seconds})
    trainer.logger.close()
    trainer.parts.engine.close()
    return {"first": steps[0], "steps": steps[1:]}


def summarise(arm: dict) -> dict:
    steps = arm["steps"]
    return {k: statistics.median(s[k] for s in steps) for k in (*KEYS, "captures", "capture_s")}


def run_arm(name: str, opts) -> dict:
    path = Path(tempfile.mkdtemp(dir=opts.runs)) / f"{name}.json"
    cmd = [sys.executable, __file__, "--child", "--steps", str(opts.steps), "--runs", opts.runs, "--json", str(path),
           *(["--smoke"] if opts.smoke else [])]
    env = {**os.environ, **ARMS[name]}
    t0 = time.perf_counter()
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=opts.arm_timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out at {opts.arm_timeout}s"}
    print(run.stdout[-3000:], end="")
    if run.returncode != 0 or not path.exists():
        return {"status": f"failed (exit {run.returncode})", "stderr": run.stderr[-3000:]}
    arm = json.loads(path.read_text())
    return {"status": "ok", "process_s": time.perf_counter() - t0, "env": ARMS[name], **arm,
            "median": summarise(arm)}


def warm_up(opts) -> dict:
    cmd = [sys.executable, "-m", "podsrl", "warmup", "--config", str(PRESET), *overrides(opts),
           f"output_dir={opts.runs}/warmup-run"]
    t0 = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.warmup_timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out at {opts.warmup_timeout}s"}
    print(run.stdout[-1500:] + run.stderr[-1500:], end="")
    status = "ok" if run.returncode == 0 else f"failed (exit {run.returncode})"
    return {"status": status, "seconds": time.perf_counter() - t0}


def step_text(name: str, arm: dict) -> str:
    if arm["status"] != "ok":
        return f"{name}: {arm['status']}"
    m = arm["median"]
    return (f"{name}: update {m['time/update'] * 1e3:.1f} ms, generate {m['time/generate'] * 1e3:.1f} ms, step "
            f"{m['time/step'] * 1e3:.1f} ms, {m['captures']:.0f} captures ({m['capture_s'] * 1e3:.0f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15, help="steps per arm after the first")
    parser.add_argument("--runs", default="/tmp/study_steps_runs", help="the warm-up cache and the runs' folders")
    parser.add_argument("--json", help="the result file (written as it fills)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--warmup-timeout", type=int, default=70)
    parser.add_argument("--arm-timeout", type=int, default=55)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    Path(opts.runs).mkdir(parents=True, exist_ok=True)
    if opts.child:
        Path(opts.json).write_text(json.dumps(run_steps(opts)))
        return
    results = Results(opts.json, "study steps")
    results.put("warmup", warm_up(opts))
    lines = []
    for name in ARMS:
        arm = run_arm(name, opts)
        results.put(name, arm)
        lines.append(step_text(name, arm))
        print(f"== {lines[-1]}", flush=True)
        if arm["status"] == "ok":
            for i, s in enumerate([arm["first"], *arm["steps"]]):
                print(f"  step {i + 1}{' (first)' if i == 0 else ''}: update {s['time/update'] * 1e3:.1f} ms, "
                      f"generate {s['time/generate'] * 1e3:.1f} ms, captures {s['captures']} "
                      f"({s['capture_s'] * 1e3:.0f} ms)")
        if name == "preferred":  # the target is the study's size: not measured at the smoke's
            ok = arm["status"] == "ok" and not opts.smoke
            results.target("study update", arm["median"]["time/update"] if ok else None)
        results.summary(f"study config, per fresh process, the median over {opts.steps} step(s) after the first: "
                        + "; ".join(lines))


if __name__ == "__main__":
    main()
