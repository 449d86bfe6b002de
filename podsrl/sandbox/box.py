"""`Sandbox`: run a command on a scratch directory's files, isolated from everything else (podsrl/sandbox/jail.py).

A Sandbox owns a directory on the host (`box.path`). Each `run` copies it into the program's working directory
(/scratch, a size-bounded tmpfs in the program's own mount namespace), runs the command there, and copies the
regular files it left back into `box.path` (links and anything else are dropped). The program sees a root of its
own: the system directories and the Python prefixes read-only, its scratch directory and /tmp writable, /proc of
its own processes only, no network; it runs without any capability, under the resource limits, and everything it
started dies when it exits or when the wall clock runs out. Where isolation is impossible and the user allowed it
(`podsrl/sandbox/isolation.py`), the command runs unisolated in `box.path` itself, under the same limits.
"""

from __future__ import annotations

import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

JAIL = Path(__file__).with_name("jail.py")
RUNNER_ID = 1000  # the program's user inside, when the caller can map a second id (as root)
NOBODY = 65534  # ... and who that is outside: a user that owns nothing
PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 10.0  # wall-clock seconds; past it everything the program started is killed
    memory_bytes: int = 512 * 2**20  # address space (RLIMIT_AS)
    max_output_bytes: int = 16 * 2**10  # stdout and stderr kept, and the largest file it may write (RLIMIT_FSIZE)
    max_code_chars: int = 20_000  # the python tool's longest program
    max_processes: int = 64  # processes and threads at once (RLIMIT_NPROC, counted in its own user namespace)
    disk_bytes: int = 64 * 2**20  # size of its scratch directory, and of its /tmp (tmpfs)


@dataclass(frozen=True)
class Completed:
    returncode: int  # negative: killed by that signal
    stdout: bytes  # at most limits.max_output_bytes
    stderr: bytes
    timed_out: bool  # stopped at the wall clock


class Sandbox:
    """Isolated runs over one scratch directory: `with Sandbox(limits) as box: (box.path / "t.py").write_text(...);
    box.run([sys.executable, "t.py"])`. `read_only`: host directories to show the program read-only, at their own
    path (the Python prefixes are always shown). `files_out=False`: the program's files are not copied back (a
    caller that reads only its output saves the copy)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), read_only: tuple[str, ...] = (),
                 files_out: bool = True, isolated: bool | None = None) -> None:
        from podsrl.sandbox.isolation import require_isolation

        self.limits, self.files_out = limits, files_out
        self.isolated = require_isolation(limits.max_processes) if isolated is None else isolated
        self._work = Path(tempfile.mkdtemp(prefix="podsrl-sandbox-"))
        self.path = self._work / "scratch"
        self.path.mkdir()
        self.read_only = tuple(dict.fromkeys([sys.prefix, sys.base_prefix, *map(str, read_only)]))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self._work, ignore_errors=True)

    def run_python(self, program: str, stdin: bytes = b"", env: dict[str, str] | None = None) -> Completed:
        """`program` run as `python -I -S -c program` would run it (this interpreter), in the scratch directory,
        with the interpreter that sets up the sandbox: one interpreter start fewer than `run`."""
        return self.run([sys.executable, "-I", "-S", "-c", program], stdin, env, inline=True)

    def run(self, command: list[str], stdin: bytes = b"", env: dict[str, str] | None = None,
            inline: bool = False) -> Completed:
        """`command` run in the scratch directory (`command[0]` found on the host's PATH unless a path, and shown
        to the program only if it lies in a system directory or a Python prefix); `env` added to a bare PATH,
        HOME and TMPDIR (nothing of the caller's environment passes)."""
        program = command[0] if os.sep in command[0] else (shutil.which(command[0]) or command[0])
        call = Path(tempfile.mkdtemp(dir=self._work, prefix="call-"))
        try:
            with open(call / "stdout", "wb+") as out, open(call / "stderr", "wb+") as err:
                code, timed_out = self._spawn([program, *command[1:]], stdin, env or {}, call, out, err,
                                              command[-1] if inline else None)
                return Completed(code, _head(out, self.limits.max_output_bytes),
                                 _head(err, self.limits.max_output_bytes), timed_out)
        finally:
            shutil.rmtree(call, ignore_errors=True)

    def _spawn(self, command, stdin, env, call, out, err, inline) -> tuple[int, bool]:
        limits = self.limits
        home = "/scratch" if self.isolated else str(self.path)
        spec = {"command": command, "rlimits": self.rlimits(), "isolated": self.isolated, "scratch": str(self.path),
                "env": {"PATH": PATH, "HOME": home, "TMPDIR": "/tmp", **env},
                "root": str(call / "root"), "read_only": self.read_only, "disk_bytes": limits.disk_bytes,
                "copy_out": self.files_out, "inline": inline,
                "runner_id": RUNNER_ID if os.geteuid() == 0 else None}
        (call / "root").mkdir()
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        spec["fds"] = [ready_w, go_r]
        try:
            child = subprocess.Popen([sys.executable, "-I", "-S", str(JAIL), repr(spec)], stdin=subprocess.PIPE,
                                     stdout=out, stderr=err, cwd=self.path, env={}, pass_fds=(ready_w, go_r),
                                     start_new_session=True)
        finally:
            os.close(ready_w)
            os.close(go_r)
        deadline = time.monotonic() + limits.wall_s
        try:
            if self.isolated:
                _map_ids(child.pid, ready_r, go_w, spec["runner_id"], limits.wall_s)
            try:
                child.communicate(stdin, timeout=max(deadline - time.monotonic(), 0.01))
                return child.returncode, False
            except subprocess.TimeoutExpired:
                return child.returncode if child.returncode is not None else -signal.SIGKILL, True
        finally:  # what it started goes with it, finished or not (the namespace's init is in this group)
            os.close(ready_r)
            os.close(go_w)
            _kill_group(child)

    def rlimits(self) -> list[tuple[int, int, int]]:
        limits = self.limits
        # CPU: SIGXCPU at the soft limit, SIGKILL a second later should the code catch that signal
        found = [(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
                 *((r, v, v) for r, v in ((resource.RLIMIT_AS, limits.memory_bytes),
                                          (resource.RLIMIT_FSIZE, limits.max_output_bytes + 1),
                                          (resource.RLIMIT_CORE, 0)))]
        if self.isolated:  # counted in its own user namespace there; outside, it would count all of the user's
            found.append((resource.RLIMIT_NPROC, limits.max_processes, limits.max_processes))
        return found


def _map_ids(pid: int, ready: int, go: int, runner_id: int | None, wait_s: float) -> None:
    """Once the jail has made its user namespace, map its ids: root inside is the caller; as root, the program's
    user (`runner_id`) is `NOBODY` outside, so that RLIMIT_NPROC binds it (the kernel exempts uid 0)."""
    if not select.select([ready], [], [], wait_s)[0] or os.read(ready, 1) != b"u":
        return  # it failed before (its stderr says why) or hangs: the wall clock ends it
    try:
        if runner_id is None:
            Path(f"/proc/{pid}/setgroups").write_text("deny")
        extra = "" if runner_id is None else f"\n{runner_id} {NOBODY} 1"
        Path(f"/proc/{pid}/uid_map").write_text(f"0 {os.geteuid()} 1{extra}")
        Path(f"/proc/{pid}/gid_map").write_text(f"0 {os.getegid()} 1{extra}")
    except OSError:
        return  # the jail exits 126, reading no go
    os.write(go, b"m")


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    child.wait()


def _head(f, limit: int) -> bytes:
    f.seek(0)
    return f.read(limit)
