"""Atomic checkpoints: everything a run needs to continue exactly, and nothing loaded with pickle.

Layout of one checkpoint, `<run>/checkpoints/step-00000042/`:
    model/              save_pretrained (safetensors) + tokenizer, loadable by transformers directly
    sharded/            FSDP2 only: every rank's shards of the parameters and AdamW state
                        (torch.distributed.checkpoint; optimizer.pt then holds the param groups and scheduler)
    optimizer.pt        optimiser + scheduler state (tensors and numbers only; loaded with weights_only=True)
    rng.pt              torch RNG states (uint8 tensors; weights_only=True)
    in_flight.pt        train.async only: the batches generated ahead and not yet trained (tensors, plain values)
    generator.pt        train.async, where a stop abandoned the batch being generated: the weights it was sampled
                        from ({"version", "weights"}), so that the resumed run regenerates it exactly
    state.json          step, data position, elapsed time, counters, per-prompt statistics, python RNG
    manifest.json       sha256 of every file above, written last
It is written to a temporary directory and renamed into place, so a kill mid-write leaves no half checkpoint
under a real name; a checkpoint whose manifest is missing or whose sizes or checksums fail is skipped on resume,
with a warning naming it and why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path

import torch

from podsrl.errors import UserError
from podsrl.models.loading import SafetensorError
from podsrl.run import faults
from podsrl.run.checkpoint_readers import MANIFEST, checkpoint_dir, list_checkpoints, remove_checkpoint
from podsrl.run.lock import create_run_dir

log = logging.getLogger("podsrl")



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


def prepare_run_dir(run_dir: Path, resume: bool) -> None:
    """Create the run directory; a fresh start never mixes with (or prunes) an earlier run's checkpoints."""
    if not resume and list_checkpoints(run_dir):
        raise UserError(f"output_dir: {run_dir} already holds checkpoints of a run; continue it with "
                        f"`podsrl train --resume {run_dir}`, or choose another output_dir")
    create_run_dir(run_dir)


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer_state: dict, rng_state: dict,
                    state: dict, keep: int = 2, sharded_tensors: dict | None = None, dist_ctx=None,
                    in_flight: list[dict] | None = None, generator: dict | None = None) -> Path:
    """Rank 0 writes everything; with `sharded_tensors` (FSDP2) every rank calls this, each writes its shards into
    `sharded/` of the same temporary directory, and rank 0 completes the checkpoint after them."""
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    main = dist_ctx is None or dist_ctx.is_main
    if dist_ctx is not None:
        tmp = Path(dist_ctx.from_main(str(tmp)))
    try:
        if main:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-step-*"):  # left by a save that was killed (one writer per run dir)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        if dist_ctx is not None:
            dist_ctx.barrier()
        faults.fire("ckpt_begin", step)
        if sharded_tensors is not None:  # collective; returns once every rank's shards and the metadata are written
            save_sharded_tensors(sharded_tensors, tmp / "sharded")
        if not main:
            return final
        model.save_pretrained(tmp / "model", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        faults.fire("ckpt_model", step)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(rng_state, tmp / "rng.pt")
        if in_flight is not None:
            torch.save(in_flight, tmp / "in_flight.pt")
        if generator is not None:
            torch.save(generator, tmp / "generator.pt")
        (tmp / "state.json").write_text(json.dumps(state), encoding="utf-8")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files},
                    "sizes": {str(p.relative_to(tmp)): p.stat().st_size for p in files}}
        for p in files:  # data on disk before the manifest that vouches for it
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        faults.fire("ckpt_manifest", step)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        faults.fire("ckpt_rename", step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except (OSError, RuntimeError, SafetensorError) as e:  # torch.save and safetensors wrap OS errors
        shutil.rmtree(tmp, ignore_errors=True)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        raise UserError(f"output_dir: cannot write checkpoint {final} ({reason}); "
                        "the previous checkpoint is kept") from None
    faults.fire("ckpt_prune", step)
    prune_checkpoints(run_dir, step, keep)
    return final


# ------------------------------------------------------------------------------------------- sharded (FSDP2)

# What a torch.distributed.checkpoint `.metadata` pickle may name: its own dataclasses, torch sizes and dtypes.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")
_METADATA_GLOBALS = {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
                     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
                     ("builtins", "set"), ("builtins", "frozenset"), ("enum", "Enum")}


class _MetadataUnpickler(pickle.Unpickler):
    """Loads DCP metadata without running arbitrary code: any other global is refused."""

    def find_class(self, module: str, name: str):
        if module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def save_sharded_tensors(tensors: dict, path: Path) -> None:
    """Every rank writes its shards of `tensors` (DTensors and plain tensors only) to `path` with
    torch.distributed.checkpoint (collective); rank 0 adds `.metadata`. Values must be tensors, so loading never
    unpickles anything but the metadata, and that through an allow-list."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(path)))
    except CheckpointException as e:  # a BaseException: some rank failed to write; the message names it
        raise OSError(_last_error_line(e)) from None


def load_sharded_tensors(template: dict, path: Path) -> None:
    """Fills `template` (this rank's shards, e.g. from get_state_dict) in place from `path` (collective)."""
    import torch.distributed.checkpoint as dcp

    class Reader(dcp.FileSystemReader):
        refused: pickle.UnpicklingError | None = None  # torch 2.11 reports a failed read only as "metadata is None"

        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except pickle.UnpicklingError as e:
                    self.refused = e
                    raise
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    from torch.distributed.checkpoint.api import CheckpointException

    reader = Reader(str(path))
    try:
        dcp.load(template, storage_reader=reader)
    except (CheckpointException, RuntimeError, OSError) as e:
        cause = _last_error_line(reader.refused or e)
        raise UserError(f"checkpoint {path}: cannot load the sharded state ({cause[:300]})") from None


def _last_error_line(e: BaseException) -> str:
    """The innermost error of a (possibly multi-rank, traceback-carrying) checkpoint exception."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def _step_of(path: Path) -> int:
    try:
        return int(path.name.removeprefix("step-"))
    except ValueError:
        return -1


def prune_checkpoints(run_dir: Path, step: int, keep: int) -> None:
    """Keep the newest `keep` checkpoints up to `step` (the one just written is always among them); delete
    older ones, and any with a later step: those are leftovers of an attempt this run was resumed past, so
    they are corrupt (else resume would have picked them) and must not outrank the new, good ones. A checkpoint a
    reader pins (`podsrl eval`: podsrl/run/checkpoint_pin.py) is kept until a rotation after the reader ends."""
    existing = list_checkpoints(run_dir)
    current = [p for p in existing if _step_of(p) <= step]
    for old in [p for p in existing if _step_of(p) > step] + current[:-keep]:
        remove_checkpoint(old)


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from, or None when its manifest vouches for every file."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files, sizes = manifest["files"], manifest.get("sizes", {})
        names = list(files.items())
    except FileNotFoundError:
        return f"no {MANIFEST} (its save did not finish)"
    except OSError as e:
        return f"{MANIFEST} is unreadable ({e.strerror or e})"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is not a checkpoint manifest"
    for name, digest in names:
        try:
            size, actual = (path / name).stat().st_size, _sha256(path / name)
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} is unreadable ({e.strerror or e})"
        if name in sizes and size != sizes[name]:
            return f"{name} has {size} bytes, {sizes[name]} expected (truncated or overwritten)"
        if actual != digest:
            return f"{name} does not match its sha256 in {MANIFEST} (damaged)"
    return None


def verify_checkpoint(path: Path) -> bool:
    return checkpoint_problem(path) is None


def resume_checkpoint(run_dir: Path) -> tuple[Path | None, list[dict]]:
    """The newest checkpoint whose manifest checks out, and the newer ones skipped ({path, reason}), each of those
    logged as a warning: resuming from an older checkpoint than the user expects must never be silent. None when
    the run saved none; when it saved some and every one is damaged, a UserError naming the newest's damage:
    starting again from step 0 would throw the run away without being asked (and prune the damaged files)."""
    skipped = []
    for path in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        log.warning("resume: skipping checkpoint %s: %s", path, problem)
        skipped.append({"path": str(path), "reason": problem})
    if skipped:
        newest = skipped[0]
        raise UserError(f"--resume: no checkpoint of {run_dir} is intact; the newest, {newest['path']}: "
                        f"{newest['reason']}. Restore its files from a copy, or move {checkpoint_dir(run_dir)} away "
                        "to train the run again from step 0")
    return None, skipped


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose manifest checks out; corrupt or partial ones are skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        if verify_checkpoint(path):
            return path
    return None


def load_generator(path: Path) -> dict | None:
    """train.async: the weights of the batch a stop abandoned ({"version", "weights"}), or None."""
    if not (path / "generator.pt").is_file():
        return None
    return torch.load(path / "generator.pt", weights_only=True, map_location="cpu")


def load_in_flight(path: Path) -> list[dict]:
    """The batches an asynchronous run had generated ahead (train.async), oldest first; [] for any other run."""
    if not (path / "in_flight.pt").is_file():
        return []
    try:
        return torch.load(path / "in_flight.pt", weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path}: in_flight.pt holds something other than tensors and plain values; "
                        f"refusing to load it ({first[:200]})") from None


def in_flight_on_resume(path: Path, asynchronous: bool, step: int) -> list[dict]:
    """The batches generated ahead that a resume from `path` continues with (train.async), and one line where the
    resume toggles train.async (an asynchronous run's checkpoint has in_flight.pt, even an empty one): what becomes
    of what the checkpoint had in flight. Batches generated ahead cannot be dropped silently: refused."""
    saved = load_in_flight(path)
    if (path / "in_flight.pt").is_file() == asynchronous:
        return saved
    if asynchronous:
        log.warning("resume: train.async.enabled=true on %s, a synchronous run's checkpoint: it has no batch in "
                    "flight; the generator starts at step %d from its weights, as a new asynchronous run does",
                    path, step + 1)
    elif saved:
        raise UserError(f"checkpoint {path} holds {len(saved)} batches generated ahead by an asynchronous run "
                        "(train.async.enabled=true); resume it with train.async.enabled=true (a synchronous resume "
                        "would drop them)")
    elif (path / "generator.pt").is_file():
        log.warning("resume: train.async.enabled=false on %s, an asynchronous run's checkpoint: the batch it was "
                    "generating when it stopped is not resumed; step %d's batch is generated afresh from the "
                    "checkpoint's weights", path, step + 1)
    else:
        log.warning("resume: train.async.enabled=false on %s, an asynchronous run's checkpoint: it had no batch in "
                    "flight, so nothing is dropped; the run goes on synchronously from step %d", path, step + 1)
    return saved


def load_checkpoint_files(path: Path) -> tuple[dict, dict, dict]:
    """(optimizer_state, rng_state, state) of a verified checkpoint; tensors only, no pickled objects.

    weights_only=True refuses anything but tensors and plain containers, so a checkpoint received from someone
    else cannot run code when loaded; such a file is reported, not loaded."""
    try:
        # onto the CPU: a GPU run's checkpoint loads where that GPU is absent (optimizer.load_state_dict moves the
        # state to its parameters' device); without it torch raises a RuntimeError taken below for a bad file
        optimizer_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
        rng_state = torch.load(path / "rng.pt", weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path}: optimizer.pt/rng.pt hold something other than tensors and plain "
                        f"values; refusing to load it ({first[:200]})") from None
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"checkpoint {path}: state.json is not valid JSON ({e})") from None
    return optimizer_state, rng_state, state


def python_random_state() -> list:
    """Python's `random` state as plain values (state.json)."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_random_state(state: list) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))
