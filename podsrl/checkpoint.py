"""Atomic checkpoints: everything a run needs to continue exactly, and nothing loaded with pickle.

Layout of one checkpoint, `<run>/checkpoints/step-00000042/`:
    model/              save_pretrained (safetensors) + tokenizer, loadable by transformers directly
    optimizer.pt        optimiser + scheduler state (tensors and numbers only; loaded with weights_only=True)
    rng.pt              torch RNG states (uint8 tensors; weights_only=True)
    state.json          step, data position, elapsed time, counters, per-prompt statistics, python RNG
    manifest.json       sha256 of every file above, written last
It is written to a temporary directory and renamed into place, so a kill mid-write leaves no half checkpoint
under a real name; a checkpoint whose manifest is missing or whose checksums fail is skipped on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from podsrl.errors import UserError

MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer_state: dict, rng_state: dict,
                    state: dict, keep: int = 2) -> Path:
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        model.save_pretrained(tmp / "model", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(rng_state, tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(state), encoding="utf-8")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
        for p in files:  # data on disk before the manifest that vouches for it
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"output_dir: cannot write checkpoint {final} ({e.strerror or e}); "
                        "the previous checkpoint is kept") from None
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories with a final name, oldest first (validity not checked)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def verify_checkpoint(path: Path) -> bool:
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        return all(_sha256(path / name) == digest for name, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose manifest checks out; corrupt or partial ones are skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        if verify_checkpoint(path):
            return path
    return None


def load_checkpoint_files(path: Path) -> tuple[dict, dict, dict]:
    """(optimizer_state, rng_state, state) of a verified checkpoint; tensors only, no pickled objects."""
    optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
    rng_state = torch.load(path / "rng.pt", weights_only=True)
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    return optimizer_state, rng_state, state
