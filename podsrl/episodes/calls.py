"""Calls into user code (environments' `reset` and `step`, tools) on daemon threads, each under a time limit.

Python cannot stop a thread, so a call that runs past its limit is abandoned: its caller goes on without it (the
episode ends, or the model is told) and its thread stays busy until the call returns. Those threads are counted:
more than `max_hung` of them at once stops the run with one line naming the calls (`HungCalls`), so a tool that
never returns cannot pile up threads without bound. The threads are daemons, so interpreter exit never waits for a
hung call, and idle ones are reused.

A stop asked of the process (`STOP`, set by the trainer on SIGTERM/SIGINT) ends every wait within POLL_S seconds
with `Interrupted`, whatever the calls are doing, so a signal is honoured in bounded time.

User code that forks comes back to a worker in the child too (a `sys.exit` there, a return, an error): that child
ends there, as an interpreter would, instead of living on as a copy of the trainer. The processes calls start and
leave running are ended when their batch of episodes is over and at the end of the run (`end_children`,
podsrl/episodes/children.py), with one warning naming the call.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from podsrl.episodes.children import ChildProcesses
from podsrl.errors import UserError

log = logging.getLogger("podsrl")

POLL_S = 0.05  # how often a wait looks at STOP
STOP = threading.Event()  # set: give up every wait (the step in flight is abandoned)
MAX_IDLE_WORKERS = 64


class Interrupted(Exception):
    """A stop was requested while calls into user code were pending: the work in flight is abandoned."""


class HungCalls(UserError):
    """Too many calls ran past their time limit and never returned (each holds a thread)."""


@dataclass
class Call:
    label: str  # what is called, for messages: a tool's name, "MyEnv.step"
    fn: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    limit_s: float = math.inf


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None  # what the call raised, SystemExit and KeyboardInterrupt included
    timed_out: bool = False
    seconds: float = 0.0  # how long the caller waited for it


class _Job:
    __slots__ = ("call", "cv", "outcome", "abandoned")

    def __init__(self, call: Call, cv: threading.Condition) -> None:
        self.call, self.cv = call, cv
        self.outcome: Outcome | None = None
        self.abandoned = False  # past its limit: counted as hung until it returns


class CallPool:
    def __init__(self, max_hung: int = 32) -> None:
        self.max_hung = max_hung
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # each idle worker's job queue
        self._hung: Counter[str] = Counter()  # label -> abandoned calls still running
        self._busy: dict[int, bool] = {}  # each worker thread's native id -> running a call
        self.children = ChildProcesses()
        self._warned: set[str] = set()  # labels whose left processes were named once

    @property
    def hung(self) -> int:
        with self._lock:
            return sum(self._hung.values())

    def run(self, calls: list[Call], parallel: int) -> list[Outcome]:
        """Run `calls`, at most `parallel` at once, each given its `limit_s` from when it starts; their outcomes in
        order. Raises Interrupted once STOP is set, HungCalls when too many calls hang."""
        cv = threading.Condition()
        pending = deque(range(len(calls)))
        running: dict[int, tuple[_Job, float, float]] = {}  # index -> (job, start, deadline)
        outcomes: list[Outcome | None] = [None] * len(calls)
        while pending or running:
            while pending and len(running) < parallel:
                i = pending.popleft()
                if calls[i].limit_s <= 0:  # no time left (an episode's whole budget spent): not started
                    outcomes[i] = Outcome(timed_out=True)
                    continue
                start = time.monotonic()
                running[i] = (self._start(calls[i], cv), start, start + calls[i].limit_s)
            with cv:
                now = time.monotonic()
                for i, (job, start, deadline) in list(running.items()):
                    if job.outcome is not None:
                        outcomes[i] = job.outcome
                    elif now >= deadline:
                        job.abandoned = True
                        outcomes[i] = Outcome(timed_out=True, seconds=now - start)
                        with self._lock:
                            self._hung[job.call.label] += 1
                    else:
                        continue
                    del running[i]
                if STOP.is_set():
                    raise Interrupted("stop requested while calls were running")
                self._check_hung()
                if running and not (pending and len(running) < parallel):  # else: start the next call first
                    cv.wait(max(0.0, min(POLL_S, min(d for _, _, d in running.values()) - now)))
        return outcomes

    def _check_hung(self) -> None:
        with self._lock:
            total = sum(self._hung.values())
            if total <= self.max_hung:
                return
            named = ", ".join(f"{label}: {n}" for label, n in self._hung.most_common())
        raise HungCalls(f"episode: {total} calls ran past their time limit and never returned ({named}); each "
                        f"holds a thread. Fix what hangs, or raise episode.max_hung_calls ({self.max_hung})")

    def _start(self, call: Call, cv: threading.Condition) -> _Job:
        job = _Job(call, cv)
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(jobs,), name="podsrl-call", daemon=True).start()
        jobs.put(job)
        return job

    def end_children(self, everything: bool = False) -> None:
        """End the processes calls started and left running: those of idle workers (a batch of episodes is over),
        or with `everything` (the end of the run) those of calls still running too. One warning per call label."""
        with self._lock:
            tids = [tid for tid, busy in self._busy.items() if everything or not busy]
        for label, count in self.children.end(tids).items():
            if label not in self._warned:
                self._warned.add(label)
                log.warning("episode: %s left %d processes running when its episodes ended; podsrl ended them. "
                            "An environment or tool waits for or stops the processes it starts (one shared by "
                            "episodes is started outside reset, step and tools, e.g. in its Task's constructor); "
                            "later ones are ended too and counted at the end of the run", label, count)
        if everything and self.children.ended:
            log.info("episode: processes left running by calls and ended over the run: %s",
                     ", ".join(f"{label}: {n}" for label, n in self.children.ended.most_common()))

    def _work(self, jobs: queue.SimpleQueue) -> None:
        pid, tid = os.getpid(), threading.get_native_id()
        while True:
            job = jobs.get()
            with self._lock:
                self._busy[tid] = True
            t0 = time.monotonic()
            try:
                outcome = Outcome(value=job.call.fn(*job.call.args, **job.call.kwargs))
            except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too: reported as they are
                outcome = Outcome(error=e)
            if os.getpid() != pid:
                _end_forked_child(outcome)
            self.children.note(tid, job.call.label)
            outcome.seconds = time.monotonic() - t0
            with job.cv:
                job.outcome = outcome
                job.cv.notify_all()
                abandoned = job.abandoned
            with self._lock:
                self._busy[tid] = False
                if abandoned:
                    self._hung[job.call.label] -= 1
                    if not self._hung[job.call.label]:
                        del self._hung[job.call.label]
                retire = len(self._idle) >= MAX_IDLE_WORKERS
                if retire:
                    del self._busy[tid]
                else:
                    self._idle.append(jobs)
            if retire:  # its children would pass to another thread, out of sight: ended now
                self.children.end([tid])
                return


def _end_forked_child(outcome: Outcome) -> NoReturn:
    """User code forked, and its child came back to the worker (it returned, or raised SystemExit or an error): the
    child ends here as an interpreter would (its exit code, a traceback for an error, its output flushed) rather
    than live on as a copy of the trainer."""
    code, error = 0, outcome.error
    if isinstance(error, SystemExit):
        code = error.code if isinstance(error.code, int) else int(error.code is not None)
        if error.code is not None and not isinstance(error.code, int):
            print(error.code, file=sys.stderr)
    elif error is not None:
        import traceback

        traceback.print_exception(type(error), error, error.__traceback__)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


CALLS = CallPool()  # one per process: hung threads are the process's, whichever runner started them
