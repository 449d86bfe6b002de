"""`podsrl train` as two processes, so that its exit code never says "finished" for a run that did not finish.

Nothing inside a process can change the exit code of `os._exit(0)` (or of `exit(0)` in a C library) called by an
environment, a tool or a reward function: no `finally`, no atexit function runs. So the CLI, when it is the
process's own entry point (`podsrl train`, `python -m podsrl train`, torchrun's), forks once the config is read,
before the trainer is built. The child is the trainer; the parent execs itself (same pid) into a fresh interpreter
that only waits for it, so it does not keep the CLI's imports (torch) in memory beside the trainer.
The child tells the parent its exit code over a pipe on the CLI's own way out (`report_exit`), after summary.json is
written for a finished run; the parent exits with that code. A child that ends without telling it ended outside
podsrl's exit path: the parent says so in one line (stderr and run.log) and exits FAULT, so a scheduler never reads
0. A child killed by a signal: the parent ends by the same signal, so the scheduler sees what it saw before.

Signals: a signal a process sends the parent (`kill`, a scheduler's SIGTERM, torchrun's) is passed on to the
trainer; one the terminal sends its whole foreground group (Ctrl-C) reaches the trainer itself and is not passed
on again, so one Ctrl-C is one stop and a second one still aborts. The trainer dies with the parent
(PR_SET_PDEATHSIG), so a SIGKILL of the parent kills the run as it did before. Linux only; `main(argv)` called
from Python (a library use, the tests) runs in its own process as before.

The parent is also the run's subreaper (PR_SET_CHILD_SUBREAPER): a process in the trainer's tree whose parent ends
(a daemon that user code detached by a double fork, a child that outlives the trainer) becomes the parent's child
instead of init's. The parent reaps them as they end, and when the trainer has ended it ends what is still running
after a grace second, with one warning line and their count: nothing the run started outlives `podsrl train`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from pathlib import Path

from podsrl.episodes.children import GRACE_S, running_descendants
from podsrl.exit_codes import ExitCode

log = logging.getLogger("podsrl")

PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WATCHED = {*PASSED_ON, signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_report_fd: int | None = None  # the trainer's end of the pipe to its parent
_parent_pid: int | None = None  # the trainer's: the pid of `podsrl train` as the user and the scheduler see it


def supported() -> bool:
    return sys.platform == "linux" and hasattr(signal, "sigtimedwait")


def run_pid() -> int:
    """The pid to name for this run (run.lock): the supervising parent's, which is the one to signal."""
    return _parent_pid or os.getpid()


def supervise(run_dir: Path) -> None:
    """Returns in the trainer (the child); in the parent, waits for it and exits with its code (SystemExit)."""
    global _report_fd, _parent_pid
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    parent = os.getpid()
    # blocked from before the fork: the parent takes them with sigtimedwait (with who sent them), the trainer
    # gets its usual handlers back
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    # orphans of the trainer's tree come to this process (kept across its exec; the trainer does not inherit it)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above: die with it
            os._exit(ExitCode.FAULT)
        _report_fd, _parent_pid = write, parent
        return
    os.close(write)
    os.set_blocking(read, False)
    os.set_inheritable(read, True)
    try:  # the same pid as a fresh, small interpreter: what the CLI imported (torch) is not kept twice
        os.execv(sys.executable, [sys.executable, "-m", __name__, str(pid), str(read), str(run_dir)])
    except OSError:  # no interpreter to run: wait in this one
        raise SystemExit(_wait(pid, read, Path(run_dir))) from None


def report_exit(code: int) -> None:
    """In the trainer, on the CLI's own way out: tell the parent that `code` is podsrl's own exit code."""
    global _report_fd
    if _report_fd is not None:
        os.write(_report_fd, f"{int(code)}\n".encode())
        os.close(_report_fd)
        _report_fd = None


def _wait(pid: int, read: int, run_dir: Path) -> int:
    status = None
    while status is None:
        info = signal.sigtimedwait(WATCHED, 1.0)
        status = _reap_ended().get(pid)
        # si_code <= 0: sent by a process (kill, sigqueue, tgkill); > 0: by the kernel, e.g. the terminal's Ctrl-C,
        # which the trainer, in the same foreground group, got too
        if status is None and info is not None and info.si_signo in PASSED_ON and info.si_code <= 0:
            os.kill(pid, info.si_signo)
    left = _end_left_behind()
    if left:
        _say(f"{left} process{'es' if left > 1 else ''} the run started outlived the training process (detached by "
             "an environment, a tool or a reward function, or not ended by it): ended", run_dir, logging.WARNING)
    try:  # not blocking: a process the trainer forked may still hold the pipe's other end
        told = os.read(read, 64).decode().strip()
    except BlockingIOError:
        told = ""
    os.close(read)
    if told:
        return int(told)
    if os.WIFSIGNALED(status):
        _end_by(os.WTERMSIG(status))
    code = os.WEXITSTATUS(status)
    if code != ExitCode.FAULT:  # FAULT: an uncaught error, whose traceback is above
        _say_unfinished(pid, code, run_dir)
    return ExitCode.FAULT


def _reap_ended() -> dict[int, int]:
    """Reaps every child that has ended (the trainer, and orphans of its tree adopted as the run's subreaper):
    pid -> wait status."""
    ended = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended[pid] = status


def _end_left_behind() -> int:
    """After the trainer: what its tree left running (adopted here), given GRACE_S to end by itself (the trainer's
    own children end on its death), then ended with SIGKILL and reaped. Returns how many had to be ended."""
    deadline = time.monotonic() + GRACE_S
    while (left := running_descendants(os.getpid())) and time.monotonic() < deadline:
        _reap_ended()
        time.sleep(0.02)
    ended = set()
    for _ in range(3):  # one may fork while the tree is read: read it again until nothing runs
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ended.update(left)
        time.sleep(0.02)
        _reap_ended()
        left = running_descendants(os.getpid())
        if not left:
            break
    return len(ended)


def _end_by(signum: int) -> None:
    """End this process by `signum`, as the trainer ended."""
    sys.stdout.flush()
    sys.stderr.flush()
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # a signal whose default is not to end the process


def _say_unfinished(pid: int, code: int, run_dir: Path) -> None:
    _say(f"the training process (pid {pid}) ended with exit code {code} outside podsrl's own exit, before the run "
         f"finished (no summary.json): code in an environment, a tool or a reward function ended it (os._exit, "
         f"sys.exit, a C library's exit()); exit code {int(ExitCode.FAULT)}. What its last checkpoint holds is "
         f"kept: `podsrl train --resume {run_dir}` continues from there", run_dir, logging.ERROR)


def _say(message: str, run_dir: Path, level: int) -> None:
    """One line on stderr and, once the trainer got as far as the run directory, in its run.log."""
    from podsrl.run.log import RunLog

    print(f"podsrl: {logging.getLevelName(level).lower()}: {message}", file=sys.stderr)
    if (run_dir / "config.yaml").is_file():
        run_log = RunLog(run_dir)
        log.propagate, propagate = False, log.propagate  # stderr has it already
        try:
            log.log(level, message)
        finally:
            log.propagate = propagate
            run_log.close()


if __name__ == "__main__":  # the parent, after supervise's exec: trainer pid, pipe's read end, run directory
    sys.exit(_wait(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])))
