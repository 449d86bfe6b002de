"""One program run through the jail (podsrl/sandbox/jail.py): the caller's side of a sandboxed call.

The jail is started as `python -I -S jail.py SPEC` in a session of its own, its stdout and stderr files of the
caller's; once it has made its user namespace the caller writes the namespace's id maps (from outside, where it has
the right to map a second id when it is root) and lets it go on; past the wall clock, or once it has exited, the
whole session is killed, the namespace's init with it (and so everything in the namespace).
"""

from __future__ import annotations

import functools
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


def launch(command: list[str], stdin: bytes, env: dict[str, str], limits: SandboxLimits, scratch: Path,
           isolated: bool, read_only: tuple[str, ...] = (), files_out: bool = True,
           inline: str | None = None) -> Completed:
    """`command` run on `scratch`'s files (isolated: a copy of them in its /scratch, copied back if `files_out`;
    unisolated: in `scratch` itself); `inline`: a Python program run in the jail's interpreter instead."""
    call = Path(tempfile.mkdtemp(dir=scratch.parent, prefix="call-"))
    spec = {"command": command, "rlimits": rlimits(limits, isolated), "isolated": isolated, "scratch": str(scratch),
            "env": {"PATH": PATH, "HOME": "/scratch" if isolated else str(scratch), "TMPDIR": "/tmp", **env},
            "root": str(call / "root"), "read_only": read_only, "disk_bytes": limits.disk_bytes,
            "copy_out": files_out, "inline": inline, "runner_id": runner_id()}
    try:
        (call / "root").mkdir()
        with open(call / "stdout", "wb+") as out, open(call / "stderr", "wb+") as err:
            code, timed_out = _spawn(spec, stdin, limits.wall_s, out, err)
            return Completed(code, _head(out, limits.max_output_bytes), _head(err, limits.max_output_bytes),
                             timed_out)
    finally:
        shutil.rmtree(call, ignore_errors=True)


def _spawn(spec: dict, stdin: bytes, wall_s: float, out, err) -> tuple[int, bool]:
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    spec["fds"] = [ready_w, go_r]
    try:
        child = subprocess.Popen([sys.executable, "-I", "-S", str(JAIL), repr(spec)], stdin=subprocess.PIPE,
                                 stdout=out, stderr=err, cwd=spec["scratch"], env={}, pass_fds=(ready_w, go_r),
                                 start_new_session=True)
    finally:
        os.close(ready_w)
        os.close(go_r)
    deadline = time.monotonic() + wall_s
    try:
        if spec["isolated"]:
            _map_ids(child.pid, ready_r, go_w, spec["runner_id"], wall_s)
        try:
            child.communicate(stdin, timeout=max(deadline - time.monotonic(), 0.01))
            return child.returncode, False
        except subprocess.TimeoutExpired:
            return child.returncode if child.returncode is not None else -signal.SIGKILL, True
    finally:  # what it started goes with it, finished or not (the namespace's init is in this group)
        os.close(ready_r)
        os.close(go_w)
        _kill_group(child)


def rlimits(limits: SandboxLimits, isolated: bool) -> list[tuple[int, int, int]]:
    # CPU: SIGXCPU at the soft limit, SIGKILL a second later should the code catch that signal
    found = [(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
             *((r, v, v) for r, v in ((resource.RLIMIT_AS, limits.memory_bytes),
                                      (resource.RLIMIT_FSIZE, limits.max_output_bytes + 1),
                                      (resource.RLIMIT_CORE, 0)))]
    if isolated:  # counted in its own user namespace there; outside, it would count all of the user's processes
        found.append((resource.RLIMIT_NPROC, limits.max_processes, limits.max_processes))
    return found


@functools.cache
def runner_id() -> int | None:
    """RUNNER_ID where the caller is root of the initial user namespace, which may map a second id and must (the
    kernel exempts uid 0 from RLIMIT_NPROC); else None: the program keeps the caller's own id, without capabilities
    (an unprivileged user, or root of a container's user namespace, which is another user outside)."""
    if os.geteuid() != 0:
        return None
    try:
        return RUNNER_ID if Path("/proc/self/uid_map").read_text().split()[:3] == ["0", "0", "4294967295"] else None
    except OSError:
        return None


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
        os.write(go, b"x")  # the jail says it could not be mapped, and exits 126
        return
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
