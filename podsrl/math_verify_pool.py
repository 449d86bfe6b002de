"""A small persistent process pool with a per-item timeout, and math-verify answer checking on top of it.

Why processes: math-verify is not thread-safe (it times out with signal.alarm, which only works on the main
thread) and some inputs make sympy run for seconds or forever. Each worker runs items on its own main thread;
an item that runs past `item_timeout_s` gets its worker killed and replaced, and reports TIMEOUT. Workers are
started with the forkserver (or spawn) context so they never inherit the trainer's threads, CUDA state or locks.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from podsrl.answers import answer_region
from podsrl.extras import require

TIMEOUT = "timeout"  # status of an item whose worker was killed for running past the deadline
CRASHED = "crashed"  # status of an item whose worker died (segfault, out of memory)
STARTUP_TIMEOUT_S = 120.0  # a worker that is not ready by then means the pool cannot work at all


def _worker_main(conn: Connection, fn: Callable[[Any], Any], init: Callable[[], None] | None) -> None:
    """Worker loop: run `init`, say ready, then answer (index, item) messages until told to stop."""
    if init is not None:
        init()
    conn.send(("ready", None, None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if message is None:
            return
        index, item = message
        try:
            conn.send(("ok", index, fn(item)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
            conn.send(("error", index, f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, ctx: Any, fn: Callable[[Any], Any], init: Callable[[], None] | None) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, fn, init), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.index: int | None = None  # item being worked on
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S  # until ready, then per item

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class ProcessPool:
    """`map(items)` runs the module-level function `fn` on each item in worker processes.

    Results come back in order as `(status, value)`: ("ok", fn(item)), ("error", message), (TIMEOUT, None) or
    (CRASHED, None). Calls are serialised by a lock, so the pool may be shared between threads.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        workers: int = 2,
        item_timeout_s: float = 5.0,
        init: Callable[[], None] | None = None,
        context: str | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if context is None:
            context = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        self._ctx = mp.get_context(context)
        self._fn, self._init = fn, init
        self.num_workers = workers
        self.item_timeout_s = float(item_timeout_s)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.restarts = 0  # workers replaced after a timeout or crash (for diagnostics)

    def _start(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self._fn, self._init))

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self._fn, self._init)
        self.restarts += 1

    def map(self, items: Sequence[Any]) -> list[tuple[str, Any]]:
        with self._lock:
            self._start()
            results: list[tuple[str, Any] | None] = [None] * len(items)
            todo = deque(range(len(items)))
            while todo or any(w.index is not None for w in self._workers):
                for w in self._workers:
                    if w.ready and w.index is None and todo:
                        w.index = todo.popleft()
                        w.deadline = time.monotonic() + self.item_timeout_s
                        w.conn.send((w.index, items[w.index]))
                busy = [w for w in self._workers if w.index is not None or not w.ready]
                next_deadline = min(w.deadline for w in busy)
                ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
                for w in busy:
                    if w.conn in ready:
                        try:
                            status, index, value = w.conn.recv()
                        except (EOFError, OSError):  # the worker died
                            if not w.ready:
                                raise RuntimeError(f"a pool worker for {self._fn.__name__} died while starting") from None
                            if w.index is not None:
                                results[w.index] = (CRASHED, None)
                            self._replace(w)
                            continue
                        if status == "ready":
                            w.ready, w.deadline = True, float("inf")
                        else:
                            results[index] = (status, value)
                            w.index, w.deadline = None, float("inf")
                    elif not w.ready and time.monotonic() >= w.deadline:
                        raise RuntimeError(f"a pool worker for {self._fn.__name__} did not start in time")
                    elif w.index is not None and time.monotonic() >= w.deadline:
                        results[w.index] = (TIMEOUT, None)
                        self._replace(w)
            return [r if r is not None else (CRASHED, None) for r in results]

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                try:
                    w.conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
            for w in self._workers:
                w.proc.join(timeout=1)
                w.kill()
            self._workers = []

    def __enter__(self) -> ProcessPool:  # noqa: PYI034 - no typing_extensions dependency for Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# math-verify on top of the pool

def _import_math_verify() -> None:
    import math_verify  # noqa: F401 - pay the import (sympy) before the first deadline starts


def _inner_timeout(item_timeout_s: float) -> int:
    """math-verify's own signal timeout (whole seconds), below the pool's kill deadline so a slow sympy call
    usually ends as a cheap in-worker timeout instead of a worker restart."""
    return max(1, int(item_timeout_s * 0.8))


def _verify_item(item: tuple[str, str, int]) -> bool | str:
    """(gold, prediction text, inner timeout) -> True/False, or TIMEOUT when math-verify's own timer fired."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    gold, pred, inner = item
    try:
        gold_parsed = parse(gold, parsing_timeout=inner, raise_on_error=True)
        if not gold_parsed:  # bare LaTeX such as "x^2+1" parses better inside math delimiters
            gold_parsed = parse(f"${gold}$", parsing_timeout=inner, raise_on_error=True)
        pred_parsed = parse(pred, extraction_mode="first_match", parsing_timeout=inner, raise_on_error=True)
        if not pred_parsed:  # a bare LaTeX answer such as \dfrac{1}{2}: as for the gold
            pred_parsed = parse(f"${pred}$", parsing_timeout=inner, raise_on_error=True)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=inner, raise_on_error=True))
    except TimeoutException:
        return TIMEOUT
    except Exception:  # noqa: BLE001 - unparsable model output is simply not a correct answer
        return False


class MathVerifyPool:
    """Checks completions against gold answers with math-verify in worker processes.

    `check(golds, completions)` returns, per item, True/False, or None when checking timed out (the worker ran
    past `item_timeout_s` and was replaced, or math-verify's own timer fired) or the worker crashed.
    """

    def __init__(
        self, workers: int = 2, item_timeout_s: float = 5.0, max_chars: int = 2000, context: str | None = None
    ) -> None:
        require("math_verify", "checking answers with math-verify")  # else every worker dies while starting
        self.max_chars = max_chars
        self._pool = ProcessPool(_verify_item, workers, item_timeout_s, init=_import_math_verify, context=context)

    @property
    def restarts(self) -> int:
        return self._pool.restarts

    def check(self, golds: Sequence[str], completions: Sequence[str]) -> list[bool | None]:
        if len(golds) != len(completions):
            raise ValueError("golds and completions must have the same length")
        inner = _inner_timeout(self._pool.item_timeout_s)
        items = [(str(g), answer_region(c, self.max_chars), inner) for g, c in zip(golds, completions)]
        out: list[bool | None] = []
        for status, value in self._pool.map(items):
            out.append(value if status == "ok" and isinstance(value, bool) else None)
        return out

    def close(self) -> None:
        self._pool.close()


_default_pool: MathVerifyPool | None = None
_default_lock = threading.Lock()


def default_math_verify_pool() -> MathVerifyPool:
    """The process-wide pool (started on first use, closed at exit)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = MathVerifyPool()
            atexit.register(_default_pool.close)
        return _default_pool
