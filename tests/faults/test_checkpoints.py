"""Checkpoint integrity: corrupt or partial checkpoints are skipped, leftovers are cleaned, pruning never keeps a bad
checkpoint over a good one, a full or read-only run directory keeps the previous checkpoint, a checkpoint
carrying a pickle payload is refused instead of executed, and the size the start-up line announces is what a save
writes."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from podsrl.config import TinyModelConfig
from podsrl.errors import UserError
from podsrl.exit_codes import ExitCode
from podsrl.models.loading import build_char_tokenizer, build_tiny_model
from podsrl.run.checkpoint import (
    MANIFEST,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint_files,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from tests.faults.common import assert_same_run, error_line, last_step, resume_argv, train_argv


@pytest.fixture(scope="module")
def model():
    cfg = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    return build_tiny_model(cfg, build_char_tokenizer(), seed=0)


def _save(run: Path, step: int, model, keep: int = 5) -> Path:
    optimizer = {"optimizer": {"state": {0: {"exp_avg": torch.full((3,), float(step))}}, "param_groups": []}}
    rng = {"trainer": torch.Generator().manual_seed(step).get_state(), "torch": torch.get_rng_state()}
    return save_checkpoint(run, step, model, None, optimizer, rng, {"step": step}, keep=keep)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_or_partial_checkpoints_are_skipped_for_the_previous_good_one(tmp_path, model):
    for step in (2, 4, 6):
        _save(tmp_path, step, model)
    assert latest_checkpoint(tmp_path).name == "step-00000006"
    _flip_byte(tmp_path / "checkpoints" / "step-00000006" / "model" / "model.safetensors")  # bit rot
    assert latest_checkpoint(tmp_path).name == "step-00000004"
    (tmp_path / "checkpoints" / "step-00000004" / MANIFEST).unlink()  # never finished
    assert latest_checkpoint(tmp_path).name == "step-00000002"
    optimizer = tmp_path / "checkpoints" / "step-00000002" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # truncated
    assert latest_checkpoint(tmp_path) is None


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _make_unreadable(path: Path) -> None:  # a directory where the file was: unreadable even for root
    path.unlink()
    path.mkdir()


# Damage to each kind of file of a checkpoint, and the reason resume gives for skipping it.
DAMAGE = {
    "weights truncated": ("model/model.safetensors", _truncate, "model/model.safetensors has {size} bytes, {want} "
                          "expected (truncated or overwritten)"),
    "model config changed": ("model/config.json", _flip_byte,
                             "model/config.json does not match its sha256 in manifest.json (damaged)"),
    "optimizer bit rot": ("optimizer.pt", _flip_byte, "optimizer.pt does not match its sha256 in manifest.json "
                          "(damaged)"),
    "rng missing": ("rng.pt", Path.unlink, "rng.pt is missing"),
    "state unreadable": ("state.json", _make_unreadable, "state.json is unreadable (Is a directory)"),
    "manifest missing": (MANIFEST, Path.unlink, "no manifest.json (its save did not finish)"),
    "manifest garbled": (MANIFEST, lambda p: p.write_text("{\"files\": 3"), "manifest.json is not a checkpoint "
                         "manifest"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_resume_names_each_skipped_checkpoint_and_why(tmp_path, model, caplog, kind):
    name, damage, reason = DAMAGE[kind]
    good, bad = _save(tmp_path, 2, model), _save(tmp_path, 4, model)
    want = json.loads((bad / MANIFEST).read_text())["sizes"].get(name)
    damage(bad / name)
    size = (bad / name).stat().st_size if (bad / name).is_file() else None
    with caplog.at_level("WARNING", logger="podsrl"):
        found, skipped = resume_checkpoint(tmp_path)
    reason = reason.format(size=size, want=want)
    assert found == good and skipped == [{"path": str(bad), "reason": reason}]
    assert caplog.messages == [f"resume: skipping checkpoint {bad}: {reason}"]


def test_resume_past_a_damaged_checkpoint_says_so_and_loses_nothing_more(tmp_path, launcher, warm_cache,
                                                                         reference_run):
    run = tmp_path / "run"
    result = launcher.run(train_argv(run, warm_cache), env={"PODSRL_FAULTS": "term@step:5"})
    assert result.code == ExitCode.STOPPED_RESUMABLE, result.stderr[-3000:]
    latest = latest_checkpoint(run)
    assert latest.name == "step-00000005" == f"step-{last_step(run):08d}"
    _truncate(latest / "model" / "model.safetensors")  # e.g. a disk quota hit by something else
    result = launcher.run(resume_argv(run))
    assert result.code == ExitCode.FINISHED, result.stderr[-3000:]
    skipped = json.loads((run / "summary.json").read_text())["skipped_checkpoints"]
    assert [s["path"] for s in skipped] == [str(latest)]
    assert skipped[0]["reason"].startswith("model/model.safetensors has ")
    line = f"resume: skipping checkpoint {latest}: {skipped[0]['reason']}"
    assert f"WARNING {line}" in result.stderr.splitlines()
    assert f"WARNING {line}" in (run / "run.log").read_text()
    assert "resumed" in result.stderr and "at step 4" in result.stderr  # one checkpoint interval redone, exactly
    assert_same_run(run, reference_run)


def test_a_good_checkpoint_loads_back_exactly(tmp_path, model):
    path = _save(tmp_path, 3, model)
    assert verify_checkpoint(path)
    optimizer, rng, state = load_checkpoint_files(path)
    assert state == {"step": 3}
    assert torch.equal(optimizer["optimizer"]["state"][0]["exp_avg"], torch.full((3,), 3.0))
    assert torch.equal(rng["trainer"], torch.Generator().manual_seed(3).get_state())


def test_leftovers_of_a_killed_save_are_removed_by_the_next(tmp_path, model):
    _save(tmp_path, 2, model)
    stale = tmp_path / "checkpoints" / ".tmp-step-00000004-12345"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path).name == "step-00000002"  # never mistaken for a checkpoint
    _save(tmp_path, 4, model)
    assert not stale.exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000004"]


def test_pruning_keeps_the_new_checkpoint_not_a_corrupt_later_one(tmp_path, model):
    _save(tmp_path, 2, model, keep=1)
    # A later checkpoint from an attempt that died while it was being deleted: corrupt, so resume used step 2.
    shutil.copytree(tmp_path / "checkpoints" / "step-00000002", tmp_path / "checkpoints" / "step-00000008")
    (tmp_path / "checkpoints" / "step-00000008" / "rng.pt").unlink()
    assert latest_checkpoint(tmp_path).name == "step-00000002"
    _save(tmp_path, 4, model, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004"]
    assert latest_checkpoint(tmp_path).name == "step-00000004"


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_pickle_payload_is_refused_not_executed(tmp_path, launcher, reference_run):
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    (run / "summary.json").unlink()
    checkpoint = latest_checkpoint(run)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (checkpoint / "optimizer.pt").write_bytes(pickle.dumps({"optimizer": Payload()}))
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"]["optimizer.pt"] = hashlib.sha256((checkpoint / "optimizer.pt").read_bytes()).hexdigest()
    manifest["sizes"]["optimizer.pt"] = (checkpoint / "optimizer.pt").stat().st_size
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))  # a consistent checkpoint, as someone might send one
    with pytest.raises(UserError, match="refusing to load"):
        load_checkpoint_files(checkpoint)
    result = launcher.run(resume_argv(run))
    assert result.code == 2
    assert "optimizer.pt/rng.pt hold something other than tensors" in error_line(result.stderr)
    assert not marker.exists()


@pytest.mark.parametrize("fault", ["enospc", "erofs"])
def test_a_full_or_read_only_run_dir_keeps_the_previous_checkpoint(tmp_path, launcher, warm_cache, reference_run,
                                                                  fault):
    run = tmp_path / "run"
    result = launcher.run(train_argv(run, warm_cache), env={"PODSRL_FAULTS": f"{fault}@ckpt_model:4"})
    assert result.code == 2
    reason = "No space left on device" if fault == "enospc" else "Read-only file system"
    line = error_line(result.stderr)
    assert f"output_dir: cannot write checkpoint {run / 'checkpoints' / 'step-00000004'} ({reason})" in line
    assert "the previous checkpoint is kept" in line
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000002"]  # no half-written leftovers
    assert launcher.run(resume_argv(run)).code == 0  # once there is room again, the run continues exactly
    assert_same_run(run, reference_run)


@pytest.mark.parametrize("limit, writer", [(30_000, "weights (safetensors)"), (80_000, "optimiser (torch.save)")])
def test_real_write_errors_from_each_writer_are_reported(tmp_path, launcher, warm_cache, limit, writer):
    """A file-size limit makes the OS refuse the write (EFBIG) inside safetensors or torch.save, like a full disk."""
    run = tmp_path / "run"
    result = launcher.run(train_argv(run, warm_cache), fsize=limit)
    assert result.code == 2, (writer, result.stderr[-3000:])
    line = error_line(result.stderr)
    assert f"cannot write checkpoint {run / 'checkpoints' / 'step-00000002'}" in line, writer
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_checkpoint_dir(tmp_path, launcher, warm_cache):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints").chmod(0o555)
    try:
        result = launcher.run(train_argv(run, warm_cache))
    finally:
        (run / "checkpoints").chmod(0o755)
    assert result.code == 2
    assert "cannot write checkpoint" in error_line(result.stderr)


def test_the_size_the_start_up_line_says_is_what_a_save_writes(tmp_path):
    """The start-up line's checkpoint size (run/description.py, counted on the run's tensors) against the bytes a
    save writes: model/'s safetensors and optimizer.pt after an AdamW step, within 2% (headers, the optimizer's
    step counters, torch.save's per-tensor records and the tokenizer are left out), and the disk
    train.keep_checkpoints needs."""
    from podsrl.config import load_config
    from podsrl.run.description import describe_checkpoint_size

    cfg = load_config(None, ["train.keep_checkpoints=3"])
    model = build_tiny_model(TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256),
                             build_char_tokenizer(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.arange(3, 11)[None]).logits.sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, 1, model, None, {"optimizer": optimizer.state_dict()}, {}, {}, keep=3)
    written = {"model": sum(f.stat().st_size for f in (path / "model").glob("*.safetensors")),
               "training_state": (path / "optimizer.pt").stat().st_size}
    weights = sum(p.numel() * 4 for p in model.parameters())
    line = describe_checkpoint_size(cfg, model, model, sharded=False)
    total = sum(written.values())
    assert written["model"] == pytest.approx(weights, rel=0.02)
    assert written["training_state"] == pytest.approx(2 * weights, rel=0.02)
    assert line == (f"checkpoints: {3 * weights / 2**20:.1f} MiB a save (model/ {weights / 2**20:.1f} MiB, "
                    f"optimizer.pt (AdamW state) {2 * weights / 2**20:.1f} MiB); train.keep_checkpoints=3 keeps 3, "
                    f"4 on disk while the next is written: {4 * 3 * weights / 2**20:.1f} MiB")
    assert total == pytest.approx(3 * weights, rel=0.02)
