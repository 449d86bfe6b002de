"""The guard of a standard stream (podsrl/reporting/streams.py) on a pipe whose reader is gone: the first failed
write is caught and said once, the descriptor then writes to /dev/null (so Python's exit flush cannot fail), and a
progress display, the live one included, goes on in plain lines to the progress logger (run.log's)."""

from __future__ import annotations

import logging
import os

from podsrl.reporting.streams import PROGRESS, GuardedStream
from podsrl.reporting.tracking import StepProgress


def closed_pipe_stream() -> GuardedStream:
    read, write = os.pipe()
    os.close(read)
    return GuardedStream(os.fdopen(write, "w"), "stdout")


def test_a_closed_pipe_is_caught_once_and_then_goes_to_dev_null(caplog):
    stream = closed_pipe_stream()
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        for _ in range(3):
            stream.write("x" * 100_000)  # more than a pipe's buffer: the write itself fails
            stream.flush()
    assert stream.lost == "Broken pipe"
    assert [r.getMessage() for r in caplog.records] == [
        "stdout (Broken pipe) cannot be written: the run goes on, its progress lines go to run.log only"]
    assert os.path.samefile(f"/proc/self/fd/{stream.fileno()}", os.devnull)
    stream.close()


def test_a_live_display_on_a_lost_stream_goes_on_in_plain_lines(caplog):
    stream = closed_pipe_stream()
    bar = StepProgress(4, label="train", every_steps=1, stream=stream, live=True)
    PROGRESS.propagate = True  # caplog listens on the root logger; run.log's handler is on PROGRESS itself
    try:
        with caplog.at_level(logging.INFO):
            for step in range(1, 5):
                bar.update(step, reward=0.5)
                stream.write("x" * 100_000)  # what rich's refresh would meet: the pipe is gone
            bar.close()
    finally:
        PROGRESS.propagate = False
    lines = [r.getMessage() for r in caplog.records if r.name == PROGRESS.name]
    assert lines and lines[-1].startswith("train step 4/4 | reward 0.500"), lines
    stream.close()
