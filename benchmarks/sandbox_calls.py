"""Time per call of the `python` tool (podsrl/episodes/sandbox.py run_code), before and after a change.

Arms: `new` (this tree: isolated where the machine allows), `old` (the tree of `--old`, by default 2c5b616, the
last commit before the isolation: `unshare -rn python -I` alone, extracted with `git archive`). Each repeat runs
each arm in a fresh process, the arms interleaved: `--calls` calls one after another, then `--calls` calls 8 at a
time (each call's own latency is timed), and the CPU time of the sequential calls' processes (user + system, all
of them: less sensitive to the machine's load than the wall clock). A call is `print(47*86+9)`, what the arithmetic_python task's model writes.
Prints, per arm, the median per call of each repeat, then the median and range over repeats, and the JSON lines
of every repeat (the raw figures).

    python benchmarks/sandbox_calls.py [--repeats 5] [--calls 24] [--old 2c5b616]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = "print(47*86+9)"
CONCURRENT = 8


def worker(calls: int) -> dict:
    """One arm's process: per-call seconds, sequential and 8 concurrent."""
    from podsrl.episodes.sandbox import run_code

    def timed(_=None) -> float:
        start = time.perf_counter()
        assert run_code(CODE) == "4051\n"
        return time.perf_counter() - start

    timed()  # the first call pays the probe (new) or the unshare check (old)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    sequential = [timed() for _ in range(calls)]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / calls
    with ThreadPoolExecutor(CONCURRENT) as pool:
        concurrent = list(pool.map(timed, range(calls)))
    return {"sequential": sequential, "concurrent": concurrent, "cpu": [cpu]}


def run_arm(tree: Path, calls: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", str(calls)], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=24)
    parser.add_argument("--old", default="2c5b616", help="the commit of the old arm")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker)))
        return
    with tempfile.TemporaryDirectory(prefix="sandbox-calls-") as old:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old, "podsrl"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        trees = {"old": Path(old), "new": ROOT}
        medians: dict[str, dict[str, list[float]]] = {arm: {"sequential": [], "concurrent": [], "cpu": []}
                                                      for arm in trees}
        print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f} at start; old = {args.old}")
        for repeat in range(args.repeats):
            for arm, tree in trees.items():  # interleaved
                times = run_arm(tree, args.calls)
                for kind, values in times.items():
                    medians[arm][kind].append(statistics.median(values) * 1000)
                print(json.dumps({"repeat": repeat, "arm": arm, "load": round(os.getloadavg()[0], 2),
                                  **{k: [round(v * 1000, 1) for v in vs] for k, vs in times.items()}}))
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    print("\nmedian ms per call over repeats [range of the repeats' medians]; cpu: CPU ms per sequential call")
    for arm in trees:
        cells = [f"{kind} {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]" for kind, v in medians[arm].items()]
        print(f"{arm:>4}: " + ";  ".join(cells) + f"  (per-repeat sequential: {[round(v) for v in medians[arm]['sequential']]})")


if __name__ == "__main__":
    main()
