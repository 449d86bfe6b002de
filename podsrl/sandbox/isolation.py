"""Whether the sandbox (podsrl/sandbox/box.py) isolates programs on this machine, and what to do where it cannot.

The probe runs one real isolated program (`python -I -S -c pass` through the jail) once per process: isolation is
all or nothing, so the probe either passes or names the step that failed and the kernel's reason (user namespaces
disabled, /proc not mountable in a container, not Linux). The first sandbox of a process logs one line naming the
level. Where nothing can be isolated, a sandbox refuses to start (ConfigError, exit 2) unless the user allowed
unisolated programs (`episode.sandbox: unisolated`, set by the run through `allow_unisolated`), which logs a warning.
"""

from __future__ import annotations

import functools
import logging
import sys
import tempfile
import threading
from pathlib import Path

from podsrl.errors import ConfigError
from podsrl.sandbox.launch import SandboxLimits, launch

logger = logging.getLogger(__name__)
FULL = ("full isolation: own user, mount, PID, network, IPC and UTS namespaces; a new root with the system and "
        "Python read-only and a size-bounded scratch directory the only writable place; no capabilities; "
        "{processes} processes at most; everything started dies with the program")
_state = {"allow_unisolated": False, "said": False}
_lock = threading.Lock()


@functools.cache
def probe() -> str | None:
    """None where a program runs fully isolated here, else why not (one line)."""
    if not sys.platform.startswith("linux"):
        return f"no Linux namespaces on {sys.platform}"
    with tempfile.TemporaryDirectory(prefix="podsrl-sandbox-") as work:
        (Path(work) / "scratch").mkdir()
        done = launch([sys.executable, "-I", "-S", "-c", "pass"], b"", {}, SandboxLimits(wall_s=30.0),
                      Path(work) / "scratch", isolated=True, read_only=(sys.prefix, sys.base_prefix))
    if done.returncode == 0:
        return None
    said = [line for line in done.stderr.decode("utf-8", "replace").splitlines() if line.startswith("sandbox: ")]
    return said[-1].removeprefix("sandbox: ").removeprefix("cannot isolate: ") if said else \
        f"the probe exited {done.returncode}"


def allow_unisolated(allowed: bool) -> None:
    """Whether a machine that cannot isolate may run programs unisolated (episode.sandbox: unisolated)."""
    _state["allow_unisolated"] = allowed


def level_line(reason: str | None, processes: int) -> str:
    """The start-up line naming the level reached."""
    if reason is None:
        return "sandbox: " + FULL.format(processes=processes)
    return (f"sandbox: NOT isolated ({reason}): the model's programs can read and write your files and signal your "
            "processes; running anyway since episode.sandbox is 'unisolated'")


def require_isolation(processes: int) -> bool:
    """True where programs run isolated; False where they may run unisolated (allowed, with a warning); else
    ConfigError. The level is logged once per process."""
    reason = probe()
    if reason is not None and not _state["allow_unisolated"]:
        raise ConfigError(f"episode.sandbox: programs cannot be isolated on this machine ({reason}); set "
                          "episode.sandbox: unisolated to run them with access to your files and processes")
    with _lock:
        said, _state["said"] = _state["said"], True
    if not said:
        (logger.info if reason is None else logger.warning)(level_line(reason, processes))
    return reason is None
