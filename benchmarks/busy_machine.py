"""The default run's step time idle and beside one CPU-bound process: how much a busy machine slows `podsrl train`.

Each thread arm is one process that starts as `podsrl train` does (the CLI's own start-up: OpenMP settings before
torch, the default config, the thread choice of podsrl/threads.py, the trainer with RL from the shipped warm-up in
podsrl/warmups) and then takes the default run's steps on request. One competitor, `python -c "while True: pass"`
at the same priority, is started once and paused (SIGSTOP) or resumed (SIGCONT): `idle` runs steps with it paused,
`busy` with it running. Arms: `auto` (podsrl's choice: no OMP_NUM_THREADS; the threads fitted at each step to the
cores other work leaves free), `1`, `2` (OMP_NUM_THREADS, which makes waiting threads sleep), `main` (as `podsrl
train` started before it chose: torch's default threads, one per core, and OpenMP's default wait policy, which spins
before it sleeps; never fitted), and optionally `N:passive` / `N:active` (OMP_WAIT_POLICY too) or `N:spinK`
(GOMP_SPINCOUNT=K: GNU OpenMP spins K times, then sleeps).

After `--warm` untimed steps per process, every round runs every (thread arm, machine) pair for `--steps` steps, in
an order rotated by the round, so load from other users of the machine hits all arms alike (only one process works
at a time; the others wait on their stdin); `--settle N` untimed steps open each pair, so that an arm that fits its
threads to the load (auto) is timed in the state the pair names, not in the change. A pair's figure for the round is
the median of its steps (their thread counts are recorded too);
`busy/idle step time` is the median and range of the per-round ratios. "idle" means "without our competitor": the
load average and the busiest other processes are recorded every round (`--out DIR`: rounds.jsonl, summary.txt).

    python benchmarks/busy_machine.py                          # auto, 1, 2, main; 5 rounds of 2 steps per pair
    python benchmarks/busy_machine.py --threads auto 1 2 main --out docs/results/busy_machine_DATE
    python benchmarks/busy_machine.py --threads auto 1 main 2:passive --steps 3 --settle 2   # steady states
    python benchmarks/busy_machine.py --ops --threads 1 2 2:passive 2:active     # single ops: the cause
    sudo python benchmarks/busy_machine.py --cpu-quota 1 --threads auto main 1  # a container's CPU limit (cgroup)
Targets (the default run on a 2-core VM): auto's busy/idle <= 1.5x, auto idle no slower than main idle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import MIN_REPEATS, Spread, load_average, ratio  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPETITOR = [sys.executable, "-c", "while True: pass"]
# the default run, cut: no evaluation, checkpoint, or logging sinks (none of them is inside a step's time)
RUN_OVERRIDES = ["train.save_every=100000", "train.eval_every=100000", "log.progress=false",
                 "log.tensorboard=false", "log.plot=false"]


def thread_env(setting: str) -> dict[str, str]:
    """The environment of one thread arm: `auto`, `N` or `N:passive|active`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    threads, _, policy = setting.partition(":")
    if threads not in ("auto", "main"):
        env["OMP_NUM_THREADS"] = str(int(threads))
    if policy.startswith("spin"):  # GNU OpenMP's spins before a waiting thread sleeps
        env["GOMP_SPINCOUNT"] = str(int(policy[4:]))
    elif policy:
        env["OMP_WAIT_POLICY"] = policy.upper()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def others_running(limit: int = 4) -> list[str]:
    """The busiest other processes (%CPU over their lifetime, and their command), for the record."""
    out = subprocess.run(["ps", "-eo", "pcpu,args", "--sort=-pcpu", "--no-headers"], capture_output=True,
                         text=True, check=False).stdout.splitlines()
    return [line.strip()[:120] for line in out if "ps -eo" not in line][:limit]


def child(run_dir: str, torch_first: bool) -> int:
    """One arm's process: podsrl's CLI start-up, then `N` on stdin -> N steps, their seconds as a JSON list.
    `torch_first` (the `main` arm) imports torch before the CLI, which then leaves threads and wait policy alone:
    torch's default threads and OpenMP's default wait policy, as `podsrl train` ran before podsrl chose them."""
    if torch_first:
        import torch  # noqa: F401
    from podsrl import cli  # otherwise first: the OpenMP settings precede torch, as under `podsrl train`

    args = cli.parse_args(["train", f"output_dir={run_dir}", *RUN_OVERRIDES])
    cli.logging.basicConfig(level=cli.logging.INFO, format="%(levelname)s %(message)s")
    cfg = cli._load(args)
    cli._set_threads(cfg)
    import torch

    from podsrl.run.trainer import Trainer

    trainer = Trainer(cfg)
    print(json.dumps({"torch_threads": torch.get_num_threads(),
                      "wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}), flush=True)
    try:
        for line in sys.stdin:  # each step's seconds and the torch threads it ran on (auto fits them per step)
            steps = [(trainer.train_step().metrics["time/step"], torch.get_num_threads()) for _ in range(int(line))]
            print(json.dumps(steps), flush=True)
    finally:
        trainer.close()  # the run directory's lock goes with the process
    return 0


@contextlib.contextmanager
def cpu_quota_cgroup(cpus: float | None):
    """--cpu-quota: a cgroup (v2 cpu.max, else v1's cpu controller) allowing `cpus` CPUs per period, as a container's
    CPU limit does; yields the file a process joins it by writing its pid (None: no quota). Needs root."""
    if cpus is None:
        yield None
        return
    period = 100_000
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    base = Path("/sys/fs/cgroup") if v2.is_file() and "cpu" in v2.read_text().split() else Path("/sys/fs/cgroup/cpu")
    group = base / f"podsrl_busy_machine_{os.getpid()}"
    group.mkdir()
    try:
        if (group / "cpu.max").exists():
            (group / "cpu.max").write_text(f"{int(cpus * period)} {period}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():  # arms still alive go back to the root group
            (base / "cgroup.procs").write_text(pid)
        group.rmdir()


class Arm:
    """A started arm process, asked for steps one batch at a time (inside the quota's cgroup, if one is given)."""

    def __init__(self, setting: str, workdir: Path, cgroup_procs: Path | None = None) -> None:
        self.setting = setting
        command = [sys.executable, __file__, "--child", tempfile.mkdtemp(dir=workdir)]
        join = None if cgroup_procs is None else (lambda: cgroup_procs.write_text(str(os.getpid())))
        self.proc = subprocess.Popen(command + ["--torch-first"] * (setting == "main"),
                                     cwd=ROOT, env=thread_env(setting), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=join)
        self.info = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"arm {self.setting} failed:\n{self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def steps(self, n: int) -> list[list]:
        """[seconds, torch threads] of each of `n` steps."""
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def runs_main(args) -> int:
    pairs = [(setting, machine) for setting in args.threads for machine in ("idle", "busy")]
    out = Path(args.out) if args.out else None
    head = (f"machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), load average "
            f"{load_average()} (1/5/15 min); {args.repeats} rounds x {len(pairs)} pairs x {args.steps} steps of the "
            f"default run after {args.warm} untimed steps per process and {args.settle} per pair; busy: "
            f"{args.competitors} competitor{'s' * (args.competitors != 1)}"
            + (f"; the arms in a cgroup of {args.cpu_quota:g} CPUs (its quota)" if args.cpu_quota else ""))
    print(head, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped benchmark still ends its competitor
    competitors = [subprocess.Popen(COMPETITOR) for _ in range(args.competitors)]

    def signal_competitors(sig) -> None:
        for competitor in competitors:
            competitor.send_signal(sig)

    signal_competitors(signal.SIGSTOP)
    times: dict[tuple[str, str], list[float]] = {pair: [] for pair in pairs}
    try:
        with tempfile.TemporaryDirectory() as tmp, cpu_quota_cgroup(args.cpu_quota) as cgroup_procs:
            arms = {setting: Arm(setting, Path(tmp), cgroup_procs) for setting in args.threads}
            for setting, arm in arms.items():
                print(f"arm {setting}: {arm.info}", flush=True)
                arm.steps(args.warm)
            for r in range(args.repeats):
                k = r % len(pairs)
                record = {"round": r, "load_before": load_average(), "others": others_running(), "steps": {}}
                for setting, machine in pairs[k:] + pairs[:k]:
                    signal_competitors(signal.SIGCONT if machine == "busy" else signal.SIGSTOP)
                    if args.settle:  # untimed: the arm meets the machine state before it is timed in it
                        arms[setting].steps(args.settle)
                    steps = arms[setting].steps(args.steps)
                    signal_competitors(signal.SIGSTOP)
                    times[(setting, machine)].append(statistics.median(seconds for seconds, _ in steps))
                    record["steps"][f"{setting} {machine}"] = [seconds for seconds, _ in steps]
                    record.setdefault("threads", {})[f"{setting} {machine}"] = [n for _, n in steps]
                record["load_after"] = load_average()
                print(f"round {r}: " + ", ".join(f"{key} {statistics.median(v):.3f}"
                                                 for key, v in record["steps"].items())
                      + f" s/step (load {record['load_before']})", flush=True)
                if out:
                    out.mkdir(parents=True, exist_ok=True)
                    with (out / "rounds.jsonl").open("a") as f:
                        f.write(json.dumps(record) + "\n")
            for arm in arms.values():
                arm.close()
    finally:
        signal_competitors(signal.SIGCONT)
        for competitor in competitors:
            competitor.kill()
            competitor.wait()
    lines = [head] + [f"arm {setting}: {arm.info}" for setting, arm in arms.items()]
    for setting in args.threads:
        idle, busy = times[(setting, "idle")], times[(setting, "busy")]
        lines += [f"threads {setting}: idle {Spread.of(idle).text(digits=3)} s/step, beside {args.competitors} busy "
                  f"process{'es' * (args.competitors != 1)} "
                  f"{Spread.of(busy).text(digits=3)} s/step",
                  f"threads {setting}: busy/idle step time: {ratio(busy, idle).text(unit='x')}"]
    for setting in args.threads:
        if setting != "main" and "main" in args.threads:
            lines.append(f"threads {setting} idle / main idle: "
                         f"{ratio(times[(setting, 'idle')], times[('main', 'idle')]).text(unit='x')}")
    lines.append(f"load average at the end {load_average()}")
    print("\n".join(lines[1 + len(arms):]))
    if out:
        (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 0


# --ops: single ops of the default step's shapes, so that the cause shows without the rest of a step: 32 prompts x
# 64 rollouts = 2,048 decode rows through the MLP's up projection (128 -> 384), and an elementwise op.
OP_CHILD = """
import json, statistics, time, torch
x, w, y = torch.randn(2048, 128), torch.randn(128, 384), torch.randn(2048, 384)
ops = {"matmul 2048x128 @ 128x384": lambda: x @ w, "add 2048x384": lambda: y + y}
result = {"threads": torch.get_num_threads()}
for name, op in ops.items():
    for _ in range(50):
        op()
    times = []
    deadline = time.perf_counter() + SECONDS
    while time.perf_counter() < deadline:
        t = time.perf_counter(); op(); times.append(time.perf_counter() - t)
    result[name] = {"median_us": 1e6 * statistics.median(times), "mean_us": 1e6 * statistics.fmean(times),
                    "calls": len(times)}
print(json.dumps(result))
"""


def one_op_run(setting: str, busy: bool, seconds: float) -> dict:
    """Per-op times of OP_CHILD under one thread arm, idle or beside a competitor started for it."""
    record = {"threads": setting, "machine": "busy" if busy else "idle", "load_before": load_average(),
              "others": others_running()}
    competitor = subprocess.Popen(COMPETITOR) if busy else None
    try:
        done = subprocess.run([sys.executable, "-c", OP_CHILD.replace("SECONDS", str(seconds))],
                              env=thread_env(setting), capture_output=True, text=True, check=True, timeout=600)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    record.update(json.loads(done.stdout))
    return record


def ops_main(args) -> int:
    """The mean time of each op per arm (the mean carries the stalls a median hides), rounds interleaved."""
    arms = [(setting, busy) for setting in args.threads for busy in (False, True)]
    rows: dict[tuple[str, bool], list[dict]] = {arm: [] for arm in arms}
    print(f"machine: {os.cpu_count()} cores, load average {load_average()}; op times, {args.repeats} rounds",
          flush=True)
    for r in range(args.repeats):
        k = r % len(arms)
        for setting, busy in arms[k:] + arms[:k]:
            record = one_op_run(setting, busy, args.op_seconds)
            record["round"] = r
            rows[(setting, busy)].append(record)
            if args.out:
                with (Path(args.out) / "ops.jsonl").open("a") as f:
                    f.write(json.dumps(record) + "\n")
    lines = []
    for name in [key for key in rows[arms[0]][0] if key.startswith(("matmul", "add"))]:
        for setting in args.threads:
            idle = [rec[name]["mean_us"] for rec in rows[(setting, False)]]
            busy = [rec[name]["mean_us"] for rec in rows[(setting, True)]]
            lines.append(f"{name}, threads {setting}: mean idle {Spread.of(idle).text(digits=0)} us, busy "
                         f"{Spread.of(busy).text(digits=0)} us, busy/idle {ratio(busy, idle).text(unit='x')}")
    lines.append(f"load average at the end {load_average()}")
    print("\n".join(lines))
    if args.out:
        (Path(args.out) / "ops_summary.txt").write_text("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", nargs="+", default=["auto", "1", "2", "main"],
                        help="thread arms: auto (podsrl's choice), N, N:passive / N:active (OMP_WAIT_POLICY), N:spinK "
                        "(GOMP_SPINCOUNT), main "
                        "(torch's and OpenMP's defaults, as before podsrl chose)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per pair and round (default 2)")
    parser.add_argument("--competitors", type=int, default=1,
                        help="CPU-bound processes beside the busy pairs (default 1; steps only, not --ops)")
    parser.add_argument("--settle", type=int, default=0,
                        help="untimed steps at the start of each pair, after the competitor is paused or resumed: the "
                        "steady state of each machine state (auto fits its threads over a step or two); default 0")
    parser.add_argument("--warm", type=int, default=2, help="untimed steps per process first (default 2)")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"rounds (default {MIN_REPEATS})")
    parser.add_argument("--out", help="folder for the raw records and summary.txt")
    parser.add_argument("--ops", action="store_true", help="time single ops of the step's shapes instead of steps")
    parser.add_argument("--op-seconds", type=float, default=2.0, help="--ops: seconds of calls per op and arm")
    parser.add_argument("--cpu-quota", type=float, metavar="CPUS",
                        help="run the arms in a cgroup allowing CPUS CPUs (a container's CPU limit; needs root)")
    parser.add_argument("--child", metavar="RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--torch-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.torch_first)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    return ops_main(args) if args.ops else runs_main(args)


if __name__ == "__main__":
    sys.exit(main())
