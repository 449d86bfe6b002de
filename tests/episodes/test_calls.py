"""The call pool: a call past its time limit is abandoned and counted as hung until it returns, on a daemon thread
the interpreter's exit does not wait for; a call with no time left is not started; raised SystemExit is an
outcome like any error."""

from __future__ import annotations

import threading
import time

from podsrl.episodes.calls import Call, CallPool


def test_an_expired_call_is_abandoned_and_counted_as_hung_until_it_returns():
    pool, release = CallPool(max_hung=4), threading.Event()
    started = time.monotonic()
    hung, quick = pool.run([Call("slow", release.wait, limit_s=0.2), Call("quick", lambda: 7, limit_s=5)], 2)
    assert hung.timed_out and 0.2 <= time.monotonic() - started < 2 and quick.value == 7 and not quick.timed_out
    assert pool.hung == 1
    assert all(t.daemon for t in threading.enumerate() if t.name == "podsrl-call")  # exit does not wait for them
    release.set()
    deadline = time.monotonic() + 5
    while pool.hung and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.hung == 0


def test_a_call_with_no_time_left_is_not_started_and_errors_are_outcomes():
    pool, ran = CallPool(), []

    def exits():
        raise SystemExit(3)

    skipped, exited = pool.run([Call("late", lambda: ran.append(1), limit_s=0.0), Call("exits", exits)], 2)
    assert skipped.timed_out and not ran
    assert isinstance(exited.error, SystemExit) and exited.error.code == 3 and not exited.timed_out
