"""Torch threads of one process, decided once at start-up from what the run is and what the machine has.

Why: torch's CPU build splits each op over OpenMP threads that meet at a barrier when it ends, and OpenMP's default
wait policy spins there before sleeping. The built-in model's ops are small, so a step is thousands of barriers;
when other processes share the cores, a peer thread is often descheduled and the waiting one spins on a core the
peer needs. benchmarks/busy_machine.py (docs/results.md, "The default run on a busy machine") measured the default
step at ~150 s with two spinning threads on a loaded 2-core machine, ~4 s with two sleeping (OMP_WAIT_POLICY=PASSIVE)
and ~8 s with one thread. So: threads that wait sleep (`prepare_openmp`), the built-in model gets one thread (it
gains little from more: the one competitor a laptop always has cannot stall it), and a larger model the cores this
process may use, shared with the other processes of the same run on this machine (torchrun ranks, local Ray
workers), so that threads x processes never exceed the cores.

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
# Below this many parameters one thread is as fast as several on an idle machine (ops too small to split) and far
# faster on a busy one; the built-in model is 0.8M (benchmarks/busy_machine.py measures it).
SMALL_MODEL_PARAMETERS = 5_000_000
TINY_VOCAB = 128  # an upper bound of the built-in char-level vocabulary (podsrl/models/loading.py), for the estimate


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
    costs a wake-up per parallel region, which the multi-threaded (larger) models amortise."""
    env = os.environ if environ is None else environ
    if "torch" not in sys.modules:
        env.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def tiny_parameters(tiny) -> int:
    """The built-in model's parameter count from its config (embeddings tied; attention keys/values at half)."""
    h, i, layers = tiny.hidden_size, tiny.intermediate_size, tiny.num_layers
    attention = h * h * 2 + 2 * h * (h // 2) + 2 * h + h  # q, o; k, v at half the heads; biases of q, k, v
    return TINY_VOCAB * h + layers * (attention + 3 * h * i + 2 * h) + h


def ray_local_cpus(cfg) -> int:
    """Cores the run's local Ray pool takes for its workers (each on `cpus_per_worker` threads); 0 without one."""
    options = cfg.rollout.engine_options or {}
    if cfg.rollout.engine != "ray" or options.get("address") is not None:
        return 0
    return int(options.get("num_workers", 1)) * int(options.get("cpus_per_worker", 1))


def choose_threads(cfg, cores: int, environ: dict) -> ThreadChoice:
    """The thread count for this process: OMP_NUM_THREADS, else train.threads, else from the model and the cores
    left to this process: those the local Ray workers do not take, shared by torchrun's ranks on this node."""
    given = environ.get(THREADS_ENV, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise UserError(f"{THREADS_ENV}={given!r}: give a positive whole number of threads, or unset it")
        return ThreadChoice(int(given), f"{THREADS_ENV}={given}")
    if cfg.train.threads > 0:
        return ThreadChoice(cfg.train.threads, f"train.threads={cfg.train.threads}")
    ranks, workers = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)), ray_local_cpus(cfg)
    share = max(1, (cores - workers) // ranks)
    shared = f"{cores} cores" + (f", {workers} for Ray workers" if workers else "") + (
        f", shared by {ranks} ranks" if ranks > 1 else "")
    if cfg.model.name_or_path == "tiny" and cfg.model.device in ("auto", "cpu"):
        size = tiny_parameters(cfg.model.tiny)
        if size < SMALL_MODEL_PARAMETERS:
            return ThreadChoice(1, f"{shared}; the built-in model's {size / 1e6:.1f}M parameters gain little from "
                                   "more, and lose most when another process shares the cores; train.threads or "
                                   f"{THREADS_ENV} to change")
    return ThreadChoice(share, f"{shared}; train.threads or {THREADS_ENV} to change")


def apply_threads(cfg, environ: dict | None = None) -> ThreadChoice:
    """Set this process's torch threads once, at start-up, and log the choice in one line."""
    import torch

    env = os.environ if environ is None else environ
    choice = choose_threads(cfg, usable_cores(), env)
    torch.set_num_threads(choice.threads)
    log.info(choice.line())
    return choice
