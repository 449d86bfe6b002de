"""`python`: a tool that runs the model's code in a separate, limited process.

Each call runs `python -I` (no user site, no environment variables read) in a fresh scratch directory, removed
after the call, with
- CPU time (RLIMIT_CPU), address space (RLIMIT_AS), the size of any file it writes (RLIMIT_FSIZE, which bounds its
  output: stdout and stderr go to files in the scratch directory) and no core files, set in the child before the
  code runs;
- a wall-clock limit: past it the whole process group is killed;
- no network: a new network namespace (`unshare -rn`, an unprivileged user namespace) where the OS allows one,
  probed once per process; elsewhere the child's `socket` module refuses to make sockets.
What the code printed is the answer (at most `max_output_bytes`); a program that fails (an exception, a non-zero
exit, a limit reached) raises `SandboxError` with the reason and the end of its stderr, which the episode's tool
machinery answers to the model and counts as a fault of `python` (podsrl/episodes/tools.py).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Run in the child before the code: the limits, then (without a network namespace) sockets refused.
PRELUDE = """\
import resource, sys
for limit, soft, hard in {limits!r}:
    resource.setrlimit(limit, (soft, hard))
if {refuse_sockets!r}:
    import socket
    def _refused(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")
    socket.socket = socket.create_connection = socket.socketpair = socket.fromfd = _refused
del resource
code = sys.stdin.read()
exec(compile(code, "<code>", "exec"), {{"__name__": "__main__"}})
"""


class SandboxError(RuntimeError):
    """The code failed or reached a limit; the message is what the model reads."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 10.0  # wall-clock seconds, process group killed past it
    memory_bytes: int = 512 * 2**20  # address space (RLIMIT_AS)
    max_output_bytes: int = 16 * 2**10  # stdout (and each file written) at most this many bytes
    max_code_chars: int = 20_000


@functools.cache
def network_namespace() -> bool:
    """Whether `unshare -rn` can start a process in a new user and network namespace here."""
    tool = shutil.which("unshare")
    if tool is None or not sys.platform.startswith("linux"):
        return False
    try:
        return subprocess.run([tool, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_code(code: str, limits: SandboxLimits = SandboxLimits()) -> str:
    """What `code` prints on stdout, run under `limits`; SandboxError when it fails or reaches a limit."""
    if not isinstance(code, str):
        raise SandboxError(f"code must be a string, got a {type(code).__name__}")
    if len(code) > limits.max_code_chars:
        raise SandboxError(f"code is longer than {limits.max_code_chars} characters")
    import resource

    isolated = network_namespace()
    # CPU: SIGXCPU at the soft limit, SIGKILL a second later should the code catch that signal
    rlimits = [(resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
               *((r, v, v) for r, v in ((resource.RLIMIT_AS, limits.memory_bytes),
                                        (resource.RLIMIT_FSIZE, limits.max_output_bytes + 1),
                                        (resource.RLIMIT_CORE, 0)))]
    prelude = PRELUDE.format(limits=rlimits, refuse_sockets=not isolated)
    command = [*(["unshare", "-rn"] if isolated else []), sys.executable, "-I", "-c", prelude]
    scratch = Path(tempfile.mkdtemp(prefix="podsrl-python-"))
    try:
        with open(scratch / ".stdout", "wb") as out, open(scratch / ".stderr", "wb") as err:
            child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=scratch,
                                     env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(scratch)},
                                     start_new_session=True)
            try:
                child.communicate(code.encode("utf-8", "replace"), timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                raise SandboxError(f"the code ran past {limits.wall_s:g} s (wall clock) and was stopped") from None
            finally:  # what it started goes with it, finished or not
                _kill_group(child)
        stdout = _head(scratch / ".stdout", limits.max_output_bytes)
        stderr = _head(scratch / ".stderr", limits.max_output_bytes)
        if child.returncode != 0:
            raise SandboxError(_failure(child.returncode, stdout, stderr, limits))
        return stdout
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    child.wait()


def _head(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")


def _failure(code: int, stdout: str, stderr: str, limits: SandboxLimits) -> str:
    tail = "\n".join(stderr.strip().splitlines()[-3:])
    if code == -signal.SIGXCPU:
        return f"the code used more than {limits.cpu_s} s of CPU time and was stopped"
    if code == -signal.SIGKILL:  # RLIMIT_CPU's hard limit, or the system's out-of-memory killer
        return f"the code was killed (SIGKILL: past {limits.cpu_s} s of CPU time, or out of memory)"
    if code == -signal.SIGXFSZ or "File too large" in tail:
        return f"the code wrote more than {limits.max_output_bytes} bytes of output and was stopped"
    if "MemoryError" in tail:
        return f"the code used more than {limits.memory_bytes // 2**20} MiB of memory: {tail}"
    return f"exit {code}: {tail}" if tail else f"exit {code}"


def python_tool(limits: SandboxLimits = SandboxLimits()) -> Callable[[str], str]:
    """The `python` tool under `limits`, for an environment's tools (e.g. ToolEnvironment([python_tool()], ...))."""
    def python(code: str) -> str:
        """Runs Python code in a sandbox and returns what it prints.

        Args:
            code: A Python program; print the result you want to read.
        """
        return run_code(code, limits)
    return python
