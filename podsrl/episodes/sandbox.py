"""`python`: a tool that runs the model's code in the sandbox (podsrl/sandbox/box.py).

Each call runs the code as `python -I -S` would (no user site, no environment variables read; the interpreter's
site-packages on its path, their .pth files not run; in the interpreter that set up the sandbox, `run_python`) in a
sandbox of its own: isolated where the machine allows (its own root where only a scratch directory is writable, its
own PID namespace, no network, no capabilities; podsrl/sandbox/jail.py), with
- CPU time (RLIMIT_CPU), address space (RLIMIT_AS), the size of any file it writes (RLIMIT_FSIZE, which bounds its
  output too), processes (RLIMIT_NPROC), scratch space (a tmpfs) and no core files;
- a wall-clock limit: past it everything the code started is killed.
Unisolated (where the machine cannot isolate and episode.sandbox is 'unisolated') it keeps the old bounds: the
limits, the process-group kill, and no network (`unshare -rn` where allowed, else its `socket` module refuses).
What the code printed is the answer (at most `max_output_bytes`); a program that fails (an exception, a non-zero
exit, a limit reached) raises `SandboxError` with the reason and the end of its stderr, which the episode's tool
machinery answers to the model and counts as a fault of `python` (podsrl/episodes/tools.py).
"""

from __future__ import annotations

import functools
import shutil
import signal
import site
import subprocess
import sys
from collections.abc import Callable

from podsrl.sandbox.box import Sandbox, SandboxLimits
from podsrl.sandbox.isolation import require_isolation

__all__ = ["PRELUDE", "SandboxError", "SandboxLimits", "network_namespace", "python_tool", "run_code"]

# Run in the child before the code: the interpreter's site-packages, then (unisolated, without a network namespace)
# sockets refused.
PRELUDE = """\
import sys
sys.path.extend({site_packages!r})
if {refuse_sockets!r}:
    import socket
    def _refused(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")
    socket.socket = socket.create_connection = socket.socketpair = socket.fromfd = _refused
code = sys.stdin.read()
exec(compile(code, "<code>", "exec"), {{"__name__": "__main__"}})
"""


class SandboxError(RuntimeError):
    """The code failed or reached a limit; the message is what the model reads."""


@functools.cache
def network_namespace() -> bool:
    """Whether `unshare -rn` can start a process in a new user and network namespace here (the unisolated mode's
    network cut)."""
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
    with Sandbox(limits, files_out=False) as box:
        cut = not box.isolated and network_namespace()
        prelude = PRELUDE.format(site_packages=site.getsitepackages(), refuse_sockets=not box.isolated and not cut)
        stdin = code.encode("utf-8", "replace")
        done = (box.run(["unshare", "-rn", sys.executable, "-I", "-S", "-c", prelude], stdin) if cut else
                box.run_python(prelude, stdin))
    if done.timed_out:
        raise SandboxError(f"the code ran past {limits.wall_s:g} s (wall clock) and was stopped")
    stdout, stderr = (text.decode("utf-8", "replace") for text in (done.stdout, done.stderr))
    if done.returncode != 0:
        raise SandboxError(_failure(done.returncode, stdout, stderr, limits))
    return stdout


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
    """The `python` tool under `limits`, for an environment's tools (e.g. ToolEnvironment([python_tool()], ...)).
    Made where programs cannot be isolated, it refuses (ConfigError) unless episode.sandbox is 'unisolated'."""
    require_isolation(limits.max_processes)
    def python(code: str) -> str:
        """Runs Python code in a sandbox and returns what it prints.

        Args:
            code: A Python program; print the result you want to read.
        """
        return run_code(code, limits)
    return python
