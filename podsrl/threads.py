"""Torch threads of one process, decided once at start-up from what the run is and what the machine has.

Why: torch's CPU build splits each op over OpenMP threads that meet at a barrier when it ends, and OpenMP's default
wait policy spins there before it sleeps. The built-in model's ops are small, so a step is thousands of barriers;
when other processes share the cores, a waiting thread spins on a core that its descheduled peer (or another
process) needs. On the project's loaded 2-core VM (benchmarks/busy_machine.py; docs/results.md, "The default run on
a busy machine") the default step took 110-207 s with two spinning threads, a median 1.5 s with two sleeping ones
(OMP_WAIT_POLICY=PASSIVE) and 4.5 s with one thread, which gets one share of the cores where two get two; on a
nearly idle machine sleeping costs 1.4x (0.39 s against 0.27 s: a wake-up per barrier; ACTIVE gives it back). So
waiting threads sleep (`prepare_openmp`), and a process takes the cores it may use, shared among the processes of
the same run on this machine (torchrun ranks; the cores local Ray workers take are left to them): threads x
processes never exceed the cores.

`OMP_NUM_THREADS` (read by torch at import) and `train.threads` override the choice. `prepare_openmp` runs in the
CLI entry before torch is imported, the one place the OpenMP runtime's start-up settings can still be set.
"""

from __future__ import annotations

import logging
import os
import sys
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
    """The cores this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def prepare_openmp(environ: dict | None = None) -> None:
    """Before torch is imported: threads that finish early sleep at a barrier instead of spinning, unless the user
    chose a wait policy. A spinning thread holds a core another process (or a descheduled peer) needs; sleeping
    costs a wake-up per parallel region instead."""
    env = os.environ if environ is None else environ
    if "torch" not in sys.modules:
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
    """Set this process's torch threads once, at start-up, and log the choice in one line."""
    import torch

    env = os.environ if environ is None else environ
    choice = choose_threads(cfg, usable_cores(), env)
    torch.set_num_threads(choice.threads)
    log.info(choice.line())
    return choice
