"""Bounded waits on other processes and threads: a Ray worker's result, a torch.distributed collective, the async
generator thread's batch, vLLM's workers. Each lasts at most `train.wait_timeout_s` (the trainer sets it for the
run: `configure`); one that expires raises WaitExpired, whose one line names what was waited for and where (and the
training step), and the CLI exits with ExitCode.STALLED (podsrl/exit_codes.py). A weight sync or rollout that hangs
forever without an error is the RL failure peers' users report most: here it stops, and says where."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

DEFAULT_S = 1800.0
_bound = {"seconds": DEFAULT_S, "step": None}


def configure(seconds: float) -> None:
    """The run's bound on every wait (train.wait_timeout_s)."""
    _bound["seconds"] = float(seconds)


def bound() -> float:
    return _bound["seconds"]


def at_step(step: int | None) -> None:
    """The training step running now, named by a wait that expires in it (None: outside the steps)."""
    _bound["step"] = step


class WaitExpired(RuntimeError):
    """A wait on another process or thread ran past its bound (train.wait_timeout_s, or the `setting` that bounds
    that wait, of `seconds`): `what` it waited for, `where`."""

    def __init__(self, what: str, where: str, seconds: float | None = None,
                 setting: str = "train.wait_timeout_s") -> None:
        step = _bound["step"]
        at = f", step {step}" if step is not None else ""
        waited = bound() if seconds is None else seconds
        super().__init__(f"waited {setting}={waited:g} s for {what} ({where}{at}) and got no answer")


def wait_until(condition: threading.Condition, ready: Callable[[], bool], what: str, where: str) -> None:
    """`condition.wait()` (its lock held) until `ready()`, at most the bound; then WaitExpired."""
    deadline = time.monotonic() + bound()
    while not ready():
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitExpired(what, where)
        condition.wait(left)


def join(thread: threading.Thread, what: str, where: str) -> None:
    """`thread.join()`, at most the bound; then WaitExpired."""
    thread.join(bound())
    if thread.is_alive():
        raise WaitExpired(what, where)
