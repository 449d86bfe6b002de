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
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from podsrl.exit_codes import ExitCode

log = logging.getLogger("podsrl")

PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WATCHED = {*PASSED_ON, signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1
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
    while True:
        info = signal.sigtimedwait(WATCHED, 1.0)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        # si_code <= 0: sent by a process (kill, sigqueue, tgkill); > 0: by the kernel, e.g. the terminal's Ctrl-C,
        # which the trainer, in the same foreground group, got too
        if info is not None and info.si_signo in PASSED_ON and info.si_code <= 0:
            os.kill(pid, info.si_signo)
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
    from podsrl.run.log import RunLog

    message = (f"the training process (pid {pid}) ended with exit code {code} outside podsrl's own exit, before the "
               f"run finished (no summary.json): code in an environment, a tool or a reward function ended it "
               f"(os._exit, sys.exit, a C library's exit()); exit code {int(ExitCode.FAULT)}. What its last "
               f"checkpoint holds is kept: `podsrl train --resume {run_dir}` continues from there")
    print(f"podsrl: error: {message}", file=sys.stderr)
    if (run_dir / "config.yaml").is_file():  # the trainer got as far as the run directory
        run_log = RunLog(run_dir)
        log.propagate, propagate = False, log.propagate  # stderr has it already
        try:
            log.error(message)
        finally:
            log.propagate = propagate
            run_log.close()


if __name__ == "__main__":  # the parent, after supervise's exec: trainer pid, pipe's read end, run directory
    sys.exit(_wait(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])))
