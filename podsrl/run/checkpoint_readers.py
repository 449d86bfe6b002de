"""Where a run's checkpoints are, and readers' pins on them, so that `podsrl eval` of a run being trained reads a
checkpoint that rotation (train.keep_checkpoints) cannot remove under it. Light: no torch, so `podsrl eval` pins
before its slow imports.

A reader holds a shared flock(2) on `<checkpoint>/.readers` while it reads; rotation takes an exclusive one without
waiting before it removes a checkpoint, and keeps a checkpoint it cannot lock until a later save. The OS drops a
flock when its holder ends, however it ends (SIGKILL, a crash, a lost node's process), so no pin outlives its
reader: there is no stale pin to clean up and no checkpoint kept for good. A removal first renames the checkpoint
out of its name under the exclusive lock, so a reader either pins a whole checkpoint or finds it gone, never a
half-deleted one. Locks span hosts where the filesystem passes flock on, as the run directory's own lock
(podsrl/run/lock.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path

from podsrl.errors import UserError

log = logging.getLogger("podsrl")

MANIFEST = "manifest.json"  # written last into a checkpoint, before it is renamed into place: a named one is whole
READERS = ".readers"
REMOVED_PREFIX = ".tmp-step-removed-"  # a removal killed after its rename: cleared with a save's other .tmp-step-*


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories with a final name, oldest first (validity not checked)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


class CheckpointPin:
    """A shared lock on `checkpoint` while open; `pinned` is False where the checkpoint's directory takes no lock
    file (read-only: nothing rotates it either)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        self.pinned = fd is not None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the lock
            self._fd = None


def pin_checkpoint(checkpoint: Path) -> CheckpointPin | None:
    """A pin on `checkpoint`, or None when it is gone (removed before the pin or while waiting for it)."""
    readers = checkpoint / READERS
    try:
        fd = os.open(readers, os.O_RDONLY | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and checkpoint.is_dir():
            return CheckpointPin(None)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a removal holds its exclusive lock for a rename only: a short wait
    except OSError as e:  # a filesystem without locks: read unpinned, as the run directory's lock goes on unlocked
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            raise
    try:
        same = os.stat(readers).st_ino == os.fstat(fd).st_ino  # not renamed away while this waited
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None
    return CheckpointPin(fd)


def remove_checkpoint(checkpoint: Path) -> bool:
    """Deletes `checkpoint` unless a reader pins it (then False: a later rotation removes it)."""
    try:
        fd = os.open(checkpoint / READERS, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # already gone
        return True
    except OSError:  # no lock file possible here (read-only): nothing can be removed either way
        shutil.rmtree(checkpoint, ignore_errors=True)
        return not checkpoint.exists()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("rotation keeps checkpoint %s while a reader (podsrl eval) holds it", checkpoint)
            return False
        except OSError:  # a filesystem without locks: remove as before pins existed
            pass
        doomed = checkpoint.with_name(f"{REMOVED_PREFIX}{checkpoint.name}-{os.getpid()}")
        try:
            os.rename(checkpoint, doomed)
        except OSError:
            doomed = checkpoint
    finally:
        os.close(fd)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def pinned_model(path: str | Path) -> tuple[Path, CheckpointPin | None]:
    """The model directory `podsrl eval --model PATH` reads and the pin that keeps it (None: not a run's
    checkpoint). PATH is a model directory, a run checkpoint's `model/` (pinned, or a UserError when rotation
    removed it first) or a run directory (its newest complete checkpoint, pinned)."""
    path = Path(path)
    if path.name == "model" and path.parent.name.startswith("step-") and path.parent.parent.name == "checkpoints":
        pin = pin_checkpoint(path.parent)
        if pin is None:
            run = path.parent.parent.parent
            raise UserError(f"--model {path}: checkpoint {path.parent.name} is gone: its run removed it "
                            f"(train.keep_checkpoints) before this eval could pin it; pass the run directory, "
                            f"--model {run}, to evaluate its newest checkpoint, pinned while it is read")
        return path, pin
    if checkpoint_dir(path).is_dir() and not (path / "config.json").is_file():  # a run directory
        for checkpoint in reversed(list_checkpoints(path)):
            pin = _pin_complete(checkpoint)
            if pin is not None:
                log.info("eval: %s, the newest complete checkpoint of %s", checkpoint / "model", path)
                return checkpoint / "model", pin
        raise UserError(f"--model {path}: no complete checkpoint in {checkpoint_dir(path)}")
    return path, None


def _pin_complete(checkpoint: Path) -> CheckpointPin | None:
    pin = pin_checkpoint(checkpoint)
    if pin is not None and not (checkpoint / MANIFEST).is_file():  # not a checkpoint a save finished
        pin.close()
        return None
    return pin
