"""Processes that calls into user code (environments' `reset` and `step`, tools) start, and leave behind.

Only user code runs on the call pool's worker threads, and Linux keeps each thread's own children apart
(`/proc/self/task/<tid>/children`), so what those threads started is known exactly, without guessing from process
names or start times, and without touching what the engines, the trainer or other libraries start on other
threads. Each call's new children are noted under the call's label ("MyEnv.step") when it returns; a sweep ends
(SIGKILL: a forked copy of the trainer ignores SIGTERM, which the copied handler turns into a stop request) every
process still running in those trees, reaps the ones that are the trainer's own children, and counts them per
label. A sweep runs when a batch of episodes is over (a process an environment shares across batches is started
outside the calls, e.g. in its Task's constructor) and at the end of the run.

Why the trainer is not a subreaper (prctl PR_SET_CHILD_SUBREAPER): it would become the parent of every orphan in
its tree, the engines' and libraries' included, which it would then have to reap, and the adopted orphans land on
the main thread, where no call can be named for them. So a process that detaches itself (a double fork) is no
longer anyone's child here and is not found by a sweep; under `podsrl train` the supervising parent is the run's
subreaper and ends it when the trainer has ended (podsrl/run/supervisor.py). Without the per-thread lists (a
kernel without CONFIG_PROC_CHILDREN, or not Linux) nothing is found and nothing is ended.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

GRACE_S = 1.0  # how long a sweep lets processes that are ending (a forked child on its way out) end by themselves


def _children(pid: int | str, tid: int | str) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except (OSError, ValueError):  # gone, or no per-thread lists on this kernel
        return []


def _tree(pids: list[int]) -> list[int]:
    """`pids` and all their descendants (any thread's children)."""
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            todo += _children(pid, tid)
    return found


def running_descendants(pid: int) -> list[int]:
    """The processes below `pid` (any thread's children, and theirs) that still run (not zombies)."""
    return [p for p in _tree([pid])[1:] if (process_state(p) or "Z") not in "ZX"]


def process_state(pid: int) -> str | None:
    """The state letter of `pid` (R, S, D, Z for a zombie, ...), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]  # after "(comm)", which may hold spaces


def _running(roots: set[int]) -> dict[int, int]:
    """pid -> its root, for every process still running in the trees of `roots`."""
    return {pid: root for root in roots for pid in _tree([root]) if (process_state(pid) or "Z") not in "ZX"}


class ChildProcesses:
    """The processes started on the call pool's worker threads, by the label of the call that started them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[int, str] = {}  # pid -> the label of the call whose thread started it
        self.ended: Counter[str] = Counter()  # label -> processes a sweep ended, over the process's life

    def note(self, tid: int, label: str) -> None:
        """After a call on thread `tid` returns: its new children are `label`'s."""
        pids = _children(os.getpid(), tid)
        with self._lock:
            for pid in pids:
                self._owner.setdefault(pid, label)

    def end(self, tids: list[int]) -> Counter[str]:
        """End every process still running that threads `tids` started (and their descendants); reap those that
        ended or had ended. Returns how many were running, per label."""
        me, ended = os.getpid(), Counter()
        for _ in range(3):  # a process may fork while its tree is read: read it again until nothing is left
            roots = {pid for tid in tids for pid in _children(me, tid)}
            if not roots:
                break
            with self._lock:
                for pid in roots:
                    self._owner.setdefault(pid, "a call")
                labels = {pid: self._owner[pid] for pid in roots}
            deadline = time.monotonic() + GRACE_S
            while (running := _running(roots)) and time.monotonic() < deadline:
                time.sleep(0.01)
            for pid, root in running.items():
                ended[labels[root]] += 1
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in roots:  # ours to reap, ended now or exited before (a zombie)
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:  # reaped already, by the code that started it
                    pass
                with self._lock:
                    self._owner.pop(pid, None)
        self.ended.update(ended)
        return ended
