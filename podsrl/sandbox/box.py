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
import shutil
import sys
import tempfile
from pathlib import Path

from podsrl.sandbox.isolation import require_isolation
from podsrl.sandbox.launch import Completed, SandboxLimits, launch

__all__ = ["Completed", "Sandbox", "SandboxLimits"]


class Sandbox:
    """Isolated runs over one scratch directory: `with Sandbox(limits) as box: (box.path / "t.py").write_text(...);
    box.run([sys.executable, "t.py"])`. `read_only`: host directories to show the program read-only, at their own
    path (the Python prefixes are always shown). `files_out=False`: the program's files are not copied back (a
    caller that reads only its output saves the copy)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), read_only: tuple[str, ...] = (),
                 files_out: bool = True) -> None:
        self.limits, self.files_out = limits, files_out
        self.isolated = require_isolation(limits.max_processes)  # or ConfigError where it cannot and may not
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
        return launch([sys.executable, "-I", "-S", "-c", program], stdin, env or {}, self.limits, self.path,
                      self.isolated, self.read_only, self.files_out, inline=program)

    def run(self, command: list[str], stdin: bytes = b"", env: dict[str, str] | None = None) -> Completed:
        """`command` run in the scratch directory (`command[0]` found on the host's PATH unless a path, and shown
        to the program only if it lies in a system directory or a Python prefix); `env` added to a bare PATH,
        HOME and TMPDIR (nothing of the caller's environment passes)."""
        program = command[0] if os.sep in command[0] else (shutil.which(command[0]) or command[0])
        return launch([program, *command[1:]], stdin, env or {}, self.limits, self.path, self.isolated,
                      self.read_only, self.files_out)
