"""One writer per run directory: an advisory lock on `<run>/run.lock`, held for the life of the run.

flock(2) ties the lock to the open file, so the OS drops it when the holder ends, however it ends (SIGKILL, OOM
kill, a crash): a dead run never blocks its own resume. The file's text (pid, host, start time) only names the
holder in the message a second writer gets; a clean release clears it, so text found on a free lock means the
previous holder died holding it. On shared filesystems the lock spans hosts where the filesystem passes flock on
(NFS with lock support, Lustre mounted with `flock`); where it cannot lock at all the run goes on with a warning.
Only rank 0 of a torchrun job takes it: the ranks are one writer.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path

from podsrl.errors import UserError
from podsrl.run import supervisor
from podsrl.run.log import LOG_FILE, RunLog

log = logging.getLogger("podsrl")

LOCK_FILE = "run.lock"
APPENDED = (LOCK_FILE, LOG_FILE, "metrics.jsonl")  # the files of a run directory a resumed run writes in place
HANDOVER_S = 10.0  # the longest wait for the lock of a holder that has ended (its trainer still exiting)


def create_run_dir(run_dir: Path) -> None:
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"output_dir: cannot create {run_dir} ({e.strerror or e})") from None


def check_writable(run_dir: Path) -> None:
    """At start-up, before any work: a UserError naming the first thing of `run_dir` this process cannot write
    (the directory and its sub-directories, checkpoints/ among them, take new files; the files a run appends to
    take appends), so a read-only or foreign run directory fails at once with one line, not with a traceback at
    the first write or after a step's work. Tried, not judged from mode bits: root, ACLs and read-only mounts
    decide what a write does."""
    for path in (run_dir, *sorted(p for p in run_dir.iterdir() if p.is_dir())):
        try:
            fd, probe = tempfile.mkstemp(prefix=".podsrl-write-test-", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            _cannot_write(run_dir, path, e)
    for path in (run_dir / name for name in APPENDED):
        try:
            if path.exists():
                open(path, "a", encoding="utf-8").close()
        except OSError as e:
            _cannot_write(run_dir, path, e)


def _cannot_write(run_dir: Path, path: Path, e: OSError) -> None:
    raise UserError(f"output_dir: cannot write {path} ({e.strerror or e}); make {run_dir} writable for this user "
                    f"(e.g. chmod -R u+w {run_dir}), or copy it to a writable place and run there") from None


def _describe(holder: dict) -> str:
    if not holder:
        return "pid unknown: it is starting"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


def _ended(holder: dict) -> bool:
    """Whether the holder named in the lock file ran on this host and is gone."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: alive
        pass
    return False


class RunLock:
    """Takes the lock of `run_dir` (created if needed) or raises a UserError naming the process that holds it.
    `keep_log`: the holder also appends podsrl's log to the run's run.log until it lets go (a training run)."""

    def __init__(self, run_dir: str | Path, keep_log: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.log: RunLog | None = None
        create_run_dir(self.run_dir)
        check_writable(self.run_dir)
        self.path = self.run_dir / LOCK_FILE
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            _cannot_write(self.run_dir, self.path, e)
        self._file = os.fdopen(fd, "r+", encoding="utf-8")
        try:
            self._take(fd)
        except BlockingIOError:
            holder = self._holder()
            self._file.close()
            raise UserError(f"output_dir: {self.run_dir} is in use by another podsrl process ({_describe(holder)}); "
                            "wait for it to end or stop it, or choose another output_dir") from None
        except OSError as e:  # ENOLCK / EOPNOTSUPP: a filesystem without locks; refusing would strand its users
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                self._file.close()
                raise UserError(f"output_dir: cannot lock {self.path} ({e.strerror or e})") from None
            log.warning("cannot lock %s (%s): nothing stops a second process writing this run directory",
                        self.path, e.strerror)
        self.log = RunLog(self.run_dir) if keep_log else None  # after the lock: a refused writer never writes it
        previous = self._holder()
        if previous:
            log.warning("taking over %s from a process that ended without releasing it (%s)", self.path,
                        _describe(previous))
        self._write({"pid": supervisor.run_pid(), "host": socket.gethostname(),
                     "started": datetime.datetime.now().isoformat(timespec="seconds")})

    def _take(self, fd: int) -> None:
        """flock, waiting up to HANDOVER_S while the holder named in the file has ended on this host: its trainer
        (podsrl/run/supervisor.py), killed with it, is still letting go."""
        deadline = time.monotonic() + HANDOVER_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline or not _ended(self._holder()):
                    raise
                time.sleep(0.05)

    def _holder(self) -> dict:
        try:
            self._file.seek(0)
            holder = json.loads(self._file.read() or "{}")
        except (OSError, ValueError):
            return {"pid": "?", "host": "?", "started": "? (unreadable lock file)"}
        return holder if isinstance(holder, dict) else {}

    def _write(self, holder: dict) -> None:
        self._file.seek(0)
        self._file.truncate()
        if holder:
            self._file.write(json.dumps(holder))
        self._file.flush()

    def close(self) -> None:
        """Close the run log, clear the holder's text, then unlock (closing the file unlocks). Idempotent."""
        if self._file.closed:
            return
        if self.log is not None:
            self.log.close()
        try:
            self._write({})
        except OSError:  # a full or vanished disk: the OS still drops the lock on close
            pass
        self._file.close()

    def __enter__(self) -> RunLock:  # noqa: PYI034 - no typing_extensions dependency for Self
        return self

    def __exit__(self, *exc) -> None:
        self.close()
