"""Standard output and error that stop being writable never stop a run.

`podsrl train ... | head`, a `tee` that dies or a dropped ssh connection close the pipe the run writes its progress
to; every later write raises BrokenPipeError (EPIPE; EIO on a terminal that hung up), wherever it happens: the
progress line, a logging handler, rich, print(), or Python's own flush at interpreter exit ("Exception ignored ...
BrokenPipeError" and exit code 120). `guard_std_streams` wraps sys.stdout and sys.stderr so that the first such
error is caught where it happens, the stream's file descriptor is pointed at /dev/null (so no later writer, Python's
exit flush and child processes included, can fail on it again), and one warning says so (in run.log); the run goes
on. The progress lines that no longer reach stdout go to run.log only (`PROGRESS`, wired by podsrl/run/log.py).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import TextIO

log = logging.getLogger("podsrl")
# Progress lines of a stream that was lost: run.log's handler only (not the console's, which may be the lost one)
PROGRESS = logging.getLogger("podsrl.progress")
PROGRESS.propagate = False

_GONE = (errno.EPIPE, errno.EIO)  # the reader went away; a terminal that hung up


class GuardedStream:
    """A text stream (sys.stdout / sys.stderr) whose writes and flushes cannot fail because the other end is gone;
    everything else is the stream's own."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream, self.name_shown = stream, name
        self.lost: str | None = None  # why it was lost (the OS's words), once it is

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self._stream.write(text)
            except OSError as e:
                self._lose(e)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self._stream.flush()
            except OSError as e:
                self._lose(e)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _lose(self, error: OSError) -> None:
        if error.errno not in _GONE:
            raise error
        self.lost = error.strerror or str(error)
        try:  # what is buffered, and every later write (Python's exit flush, child processes), goes nowhere
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass
        warn_lost(f"{self.name_shown} ({self.lost})")


def warn_lost(stream: str) -> None:
    log.warning("%s cannot be written: the run goes on, its progress lines go to run.log only", stream)


def guard_std_streams() -> None:
    """Wrap sys.stdout and sys.stderr (once; a stream already wrapped, or None, is left alone). Call it before
    logging is configured, so the console handler writes through the guard."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, GuardedStream):
            setattr(sys, name, GuardedStream(stream, name))


def lost_streams() -> list[str]:
    """'stdout (Broken pipe)' for each guarded standard stream that was lost."""
    return [f"{s.name_shown} ({s.lost})" for s in (sys.stdout, sys.stderr)
            if isinstance(s, GuardedStream) and s.lost is not None]


def is_lost(stream: TextIO) -> bool:
    return isinstance(stream, GuardedStream) and stream.lost is not None
