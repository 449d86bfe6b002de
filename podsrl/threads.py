"""Torch threads of one process: decided at start-up from what the run is and what the machine has, then fitted at
each step to the cores other work leaves free.

Why: torch's CPU build splits each op over OpenMP threads that meet at a barrier when it ends, and OpenMP's default
wait policy spins there for a while before it sleeps. The built-in model's ops are small, so a step is thousands of
barriers. On a machine with cores to spare, spinning is the fast way to wait (benchmarks/busy_machine.py: 0.27 s a
step with two spinning threads on the 2-core VM, 0.39 s with two sleeping ones, OMP_WAIT_POLICY=PASSIVE: a wake-up
per barrier). When other runnable work shares the cores, a thread spins on a core that its descheduled peer (or the
other process) needs: 3-50x slower steps. So the wait policy stays OpenMP's default and `ThreadFitter` gives the run
no more threads than the cores other work leaves free: before each step it reads the machine's runnable tasks
(/proc/loadavg, less this process's own running threads) and moves to the free cores once `STEPS_TO_CHANGE` steps
in a row call for it, so that a passing task does not make it flap. Threads left out of a parallel region stop
spinning after OpenMP's spin count and sleep. Beside one busy process on two cores: 1.47x the idle step, which is
as fast as two spinning threads' (docs/results.md, "The default run on a busy machine").

The most threads a process takes: the usable cores, shared among the processes of the same run on this machine
(torchrun ranks; the cores local Ray workers take are left to them). `OMP_NUM_THREADS` (read by torch at import),
`train.threads` or `OMP_WAIT_POLICY` set by the user fix the count: no fitting. With `OMP_NUM_THREADS` the waiting
threads sleep (`prepare_openmp`), as a fixed count beside other work needs. `prepare_openmp` runs in the CLI entry
before torch is imported, the one place the OpenMP runtime's start-up settings can still be set.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass

from podsrl.errors import UserError

log = logging.getLogger(__name__)

THREADS_ENV = "OMP_NUM_THREADS"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str

    def line(self) -> str:
        return f"threads: {self.threads} torch thread{'s' if self.threads != 1 else ''} per process ({self.why})"


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (taskset's, a cpuset's: not the host's count), and no more
    than its cgroup's CPU quota allows (a container's CPU limit, e.g. Kubernetes' `limits.cpu`: threads beyond it are
    throttled, each barrier waiting for a thread the quota has stopped)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, int(quota)))


def cpu_quota(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs per period this process's cgroup and its parents allow at most (cgroup v2 cpu.max, v1
    cpu.cfs_quota_us / cpu.cfs_period_us), the tightest on the way up; None where none is set or none can be read."""
    try:
        with open(f"{proc}/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    limits = []
    for _, controllers, path in (line for line in lines if len(line) == 3):
        if controllers == "":  # v2: one hierarchy
            limits += [_v2_limit(d) for d in _up(f"{cgroup_root}{path}", cgroup_root)]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            base = next((f"{cgroup_root}/{n}" for n in (controllers, "cpu", "cpu,cpuacct")
                         if os.path.isdir(f"{cgroup_root}/{n}")), None)
            if base is not None:
                limits += [_v1_limit(d) for d in _up(f"{base}{path}", base)]
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def _up(directory: str, root: str) -> list[str]:
    """`directory` and its parents up to `root`, the ones that exist (inside a container's cgroup namespace the
    process's own cgroup is the root)."""
    found, d = [], os.path.normpath(directory)
    root = os.path.normpath(root)
    while True:
        if os.path.isdir(d):
            found.append(d)
        if d == root or not d.startswith(root):
            return found
        d = os.path.dirname(d)


def _v2_limit(directory: str) -> float | None:
    text = _read(f"{directory}/cpu.max")  # "max 100000" (none) or "QUOTA PERIOD"
    fields = text.split() if text else []
    if len(fields) != 2 or fields[0] == "max":
        return None
    return int(fields[0]) / int(fields[1])


def _v1_limit(directory: str) -> float | None:
    quota, period = _read(f"{directory}/cpu.cfs_quota_us"), _read(f"{directory}/cpu.cfs_period_us")
    if not quota or not period or int(quota) <= 0:  # -1: none
        return None
    return int(quota) / int(period)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def prepare_openmp(environ: dict | None = None) -> None:
    """Before torch is imported: with a thread count fixed by OMP_NUM_THREADS (never fitted to the load), threads that
    finish early sleep at a barrier instead of spinning, unless the user chose a wait policy. A spinning thread holds
    a core another process (or a descheduled peer) needs; sleeping costs a wake-up per parallel region instead."""
    env = os.environ if environ is None else environ
    if "torch" not in sys.modules and env.get(THREADS_ENV, "").strip():
        env.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def choose_threads(cfg, cores: int, environ: dict) -> ThreadChoice:
    """The thread count for this process: OMP_NUM_THREADS, else train.threads, else the cores left to it: those the
    local Ray workers do not take, shared by torchrun's ranks on this node."""
    given = environ.get(THREADS_ENV, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise UserError(f"{THREADS_ENV}={given!r}: give a positive whole number of threads, or unset it")
        return ThreadChoice(int(given), f"{THREADS_ENV}={given}")
    if cfg.train.threads > 0:
        return ThreadChoice(cfg.train.threads, f"train.threads={cfg.train.threads}")
    ranks = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    workers = cfg.rollout.engine_type.local_worker_cores(cfg.rollout.engine_options or {})
    shared = f"{cores} usable cores" + (f", {workers} of them for the engine's workers" if workers else "") + (
        f", shared by {ranks} ranks" if ranks > 1 else "")
    return ThreadChoice(max(1, (cores - workers) // ranks), f"{shared}; train.threads or {THREADS_ENV} to change")


def apply_threads(cfg, environ: dict | None = None) -> ThreadChoice:
    """Set this process's torch threads at start-up and log the choice in one line; podsrl's own choice (nothing set
    by the user, no train.async generator thread with threads of its own) is then fitted to the load at each step."""
    import torch

    global _fitter
    env = os.environ if environ is None else environ
    cores = usable_cores()
    choice = choose_threads(cfg, cores, env)
    torch.set_num_threads(choice.threads)
    fitted = not (env.get(THREADS_ENV, "").strip() or env.get(WAIT_POLICY_ENV) or cfg.train.threads > 0
                  or cfg.train.asynchronous.enabled)
    _fitter = ThreadFitter(choice.threads, cores, torch.set_num_threads, runnable_elsewhere) if fitted else None
    log.info(choice.line() + ("; fewer while other work takes cores" if fitted else ""))
    return choice


def runnable_elsewhere(proc: str = "/proc") -> int:
    """Runnable tasks on this process's usable cores that are not its own threads: the machine's running count in
    /proc/loadavg (a snapshot, this reader included) less this process's threads in state R, scaled to the usable
    share of the machine's cores (the count is the whole machine's; assumes the load spreads evenly)."""
    with open(f"{proc}/loadavg") as f:
        running = int(f.read().split()[3].split("/")[0])
    own = 0
    for task in os.scandir(f"{proc}/self/task"):
        try:
            with open(f"{task.path}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        own += stat[stat.rindex(")") + 2] == "R"  # the state follows the command name, which may hold spaces
    share = usable_cores() / (os.cpu_count() or 1)
    return round(max(0, running - own) * share)


STEPS_TO_CHANGE = 2  # steps in a row that call for fewer (or more) threads before the count changes: a task seen
# running in one snapshot is often gone by the next step (an editor, a shell), a competitor stays
LOG_EVERY_S = 60.0  # a change of threads is logged at most this often


class ThreadFitter:
    """The torch threads of a step: at most `most`, no more than the cores other runnable work leaves free."""

    def __init__(self, most: int, cores: int, set_threads, others, clock=time.monotonic) -> None:
        self.most, self.cores, self.threads = most, cores, most
        self.set_threads, self.others, self.clock = set_threads, others, clock
        self.direction, self.streak, self.room, self.changes, self.logged_at = 0, 0, most, 0, None

    def at_step(self) -> int:
        others = self.others()
        fit = max(1, min(self.most, self.cores - others))
        direction = (fit > self.threads) - (fit < self.threads)
        if direction != self.direction:  # a new run of steps that call for a change (or for none)
            self.direction, self.streak, self.room = direction, 0, fit
        self.streak, self.room = self.streak + 1, min(self.room, fit)  # the least room the run showed
        if direction and self.streak >= STEPS_TO_CHANGE:
            self._set(self.room, others)
        return self.threads

    def _set(self, threads: int, others: int) -> None:
        self.set_threads(threads)
        self.threads, self.direction, self.streak, self.changes = threads, 0, 0, self.changes + 1
        now = self.clock()
        if self.logged_at is None or now - self.logged_at >= LOG_EVERY_S:
            log.info("torch threads now %d of %d (%d other runnable task%s on %d cores; %d change%s since the "
                     "last line)", threads, self.most, others, "" if others == 1 else "s", self.cores, self.changes,
                     "" if self.changes == 1 else "s")
            self.logged_at, self.changes = now, 0


_fitter: ThreadFitter | None = None


def fit_threads_to_load() -> None:
    """Before a step: this process's threads fitted to the free cores, when podsrl chose them (`apply_threads`)."""
    if _fitter is not None:
        _fitter.at_step()
