#!/usr/bin/env python3
"""Do the method regression replays hold on CPUs whose kernels sum floats in another order?

    PYTHONPATH=$PWD python tools/check_cpu_kernels.py [--out FILE.json]

Another CPU changes the order of float32 sums (SIMD width, oneDNN's kernels, threads), not the code. This replays
every case of tests/method_regression.py in a fresh process per setting, with the settings that change CPU kernels
on one machine: the SIMD level torch dispatches to (ATEN_CPU_CAPABILITY: `default` is scalar code, the others as
far as this CPU has them), the thread count, oneDNN on or off, and oneDNN's float32 matmul precision (`bf16`/`tf32`
only change results on CPUs with those units; elsewhere they fall back to IEEE float32). For each setting it prints
the exact metrics that differ (must be none), the largest relative drift of the float32 aggregates and the test's
tolerance (tests/methods/test_method_regression.py), so the margin is visible, not only pass or fail.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (name, environment, torch settings applied in the child)
SETTINGS = [
    ("native, 1 thread", {}, {"threads": 1}),
    ("native, 2 threads", {}, {"threads": 2}),
    ("native, 4 threads", {}, {"threads": 4}),
    ("scalar kernels, 1 thread", {"ATEN_CPU_CAPABILITY": "default"}, {"threads": 1}),
    ("scalar kernels, 2 threads", {"ATEN_CPU_CAPABILITY": "default"}, {"threads": 2}),
    ("AVX2 kernels, 1 thread", {"ATEN_CPU_CAPABILITY": "avx2"}, {"threads": 1}),
    ("AVX-512 kernels, 1 thread", {"ATEN_CPU_CAPABILITY": "avx512"}, {"threads": 1}),
    ("oneDNN off, 1 thread", {}, {"threads": 1, "mkldnn": False}),
    ("oneDNN off, scalar kernels", {"ATEN_CPU_CAPABILITY": "default"}, {"threads": 1, "mkldnn": False}),
    ("oneDNN matmul bf16, 1 thread", {}, {"threads": 1, "matmul_precision": "bf16"}),
    ("oneDNN matmul tf32, 1 thread", {}, {"threads": 1, "matmul_precision": "tf32"}),
]

CHILD = """
import json, sys, tempfile, torch
settings = json.loads(sys.argv[1])
torch.set_num_threads(settings["threads"])
torch.backends.mkldnn.enabled = settings.get("mkldnn", True)
if "matmul_precision" in settings:
    torch.backends.mkldnn.matmul.fp32_precision = settings["matmul_precision"]
from tests.method_regression import CASES, run_case
with tempfile.TemporaryDirectory() as tmp:
    got = {c: run_case(c, f"{tmp}/{c}", f"{tmp}/warmup") for c in CASES}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "metrics": got}))
"""


def cpu_has(flag: str) -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and flag in cpuinfo.read_text().split()


def compare(got: dict, recorded: dict) -> dict:
    from tests.methods.test_method_regression import FLOAT32_TOLERANCE, is_float32_aggregate, matches

    exact_differ, worst, failures = [], (0.0, None), 0
    for case, steps in got.items():
        for step, (g, e) in enumerate(zip(steps, recorded[case]), start=1):
            for key, value in e.items():
                failures += not matches(key, g[key], value)
                if not is_float32_aggregate(key):
                    if g[key] != value:
                        exact_differ.append(f"{case} step {step} {key}: {g[key]} vs {value}")
                    continue
                drift = abs(g[key] - value) / max(abs(value), 1.0)  # as the tolerance applies: relative, or absolute
                if drift > worst[0]:
                    worst = (drift, f"{case} step {step} {key}")
    return {"exact_differ": exact_differ, "worst_float32_drift": worst[0], "worst_at": worst[1],
            "tolerance": FLOAT32_TOLERANCE, "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write every setting's result here (JSON)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.method_regression import FIXTURE, RECORDED_ON

    recorded = json.loads(FIXTURE.read_text())
    print(f"fixture recorded on: {recorded[RECORDED_ON]}")
    results, ok = [], True
    for name, env, settings in SETTINGS:
        if env.get("ATEN_CPU_CAPABILITY", "").startswith("avx512") and not cpu_has("avx512f"):
            # torch would take the setting and stop at its first AVX-512 instruction
            print(f"{name:32s} not on this CPU (no avx512f)")
            results.append({"setting": name, "skipped": "the CPU has no avx512f"})
            continue
        child_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        with tempfile.TemporaryDirectory():
            run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(settings)], env=child_env, cwd=ROOT,
                                 capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{name:32s} failed to run (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:]}")
            results.append({"setting": name, "error": run.stderr[-2000:]})
            ok = False
            continue
        out = json.loads(run.stdout.strip().splitlines()[-1])
        result = {"setting": name, "capability": out["capability"], **compare(out["metrics"], recorded)}
        results.append(result)
        ok &= result["failures"] == 0
        print(f"{name:32s} kernels {out['capability']:8s} exact metrics differing: {len(result['exact_differ'])}  "
              f"largest float32 drift {result['worst_float32_drift']:.2e} (tolerance {result['tolerance']:.1e}; "
              f"{result['worst_at']})  {'ok' if result['failures'] == 0 else 'FAILS'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"recorded_on": recorded[RECORDED_ON], "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
