"""Start-up checks of the files a run reads and writes: a run directory it cannot write, a warm-up that is missing
or damaged, checkpoints that are all damaged. Each ends at start-up with one line naming the file and what to do
(exit 2), and a resume never trains a warm-up its checkpoint does not need."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from podsrl.exit_codes import ExitCode
from podsrl.run.checkpoint import latest_checkpoint, list_checkpoints
from tests.checkout import pythonpath
from tests.faults.common import assert_same_run, error_line, resume_argv, tiny, train_argv

REPO = Path(__file__).resolve().parents[2]


def _own_cache(tmp_path: Path, warm_cache: str) -> Path:
    """A copy of the session's warm-up cache this test may delete or damage; its entry for these tests' runs (the
    cache may hold other tests' warm-ups too)."""
    from podsrl.config import load_config
    from podsrl.config.presets import preset_path
    from podsrl.run.warmup import warmup_path

    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    entry = warmup_path(load_config(preset_path("grpo"), tiny(tmp_path / "run", cache)))
    assert (entry / "config.json").is_file(), f"the session's warm-up cache has no {entry.name}"
    return entry


def _unprivileged(argv: list[str]) -> list[str]:
    """`python -m podsrl argv` as a process that obeys file modes: root drops the capabilities that let it write
    anywhere (as a run under a normal user, or root on a root-squashed NFS, is)."""
    command = [sys.executable, "-m", "podsrl", *argv]
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: no way to run podsrl under file permissions")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", *command]


def _set_writable(root: Path, writable: bool) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_a_read_only_run_dir_at_resume_is_one_line_naming_it(tmp_path, launcher, warm_cache):
    run = tmp_path / "run"
    assert launcher.run(train_argv(run, warm_cache, **{"train.max_steps": 2})).code == ExitCode.FINISHED
    before = sorted(p.name for p in run.rglob("*"))
    _set_writable(run, False)
    try:
        result = subprocess.run(_unprivileged([*resume_argv(run), "train.max_steps=4"]), cwd=REPO, text=True,
                                capture_output=True, timeout=600, env={**os.environ, "PYTHONPATH": pythonpath()})
    finally:
        _set_writable(run, True)
    assert result.returncode == ExitCode.USER_ERROR, result.stderr[-3000:]
    line = error_line(result.stderr)
    assert line == (f"podsrl: error: output_dir: cannot write {run} (Permission denied); make {run} writable for "
                    f"this user (e.g. chmod -R u+w {run}), or copy it to a writable place and run there")
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing written, nothing left behind
    assert launcher.run([*resume_argv(run), "train.max_steps=4"]).code == ExitCode.FINISHED  # writable again


def test_a_resume_does_not_train_a_missing_warm_up_its_checkpoint_does_not_read(tmp_path, launcher, warm_cache,
                                                                             reference_run):
    warmup = _own_cache(tmp_path, warm_cache)
    run = tmp_path / "run"
    result = launcher.run(train_argv(run, warmup.parent), env={"PODSRL_FAULTS": "term@step:5"})
    assert result.code == ExitCode.STOPPED_RESUMABLE, result.stderr[-3000:]
    shutil.rmtree(warmup)  # e.g. a cleaned cache, or the run moved to a machine without it
    result = launcher.run(resume_argv(run))
    assert result.code == ExitCode.FINISHED, result.stderr[-3000:]
    assert not warmup.exists() and "warm-up" not in result.stderr  # not trained again, not mentioned
    assert_same_run(run, reference_run)


def test_a_resume_that_needs_a_missing_warm_up_says_so_and_why(tmp_path, warm_cache, caplog):
    from podsrl.config import load_config
    from podsrl.run.warmup import resume_base_weights

    warmup = _own_cache(tmp_path, warm_cache)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000004"
    cfg = load_config(None, tiny(tmp_path / "run", warmup.parent))
    shutil.rmtree(warmup)
    with caplog.at_level(logging.INFO, logger="podsrl"):
        assert resume_base_weights(cfg, checkpoint) is None  # algo.beta = 0, full weights: nothing reads it
    assert not warmup.exists() and not caplog.messages
    cfg = load_config(None, tiny(tmp_path / "run", warmup.parent) + ["algo.beta=0.05"])
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        assert resume_base_weights(cfg, checkpoint) == str(warmup)  # trained again: the reference model needs it
    assert (warmup / "config.json").is_file()
    assert caplog.messages == [f"resume: the warm-up this run started from ({warmup}) is missing and {checkpoint} "
                               "needs it (algo.beta > 0: the reference model is the warm-up): training it again, "
                               "up to warmup.steps=10 steps"]


def test_a_damaged_warm_up_is_one_line_naming_its_file(tmp_path, launcher, warm_cache):
    warmup = _own_cache(tmp_path, warm_cache)
    weights = warmup / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    result = launcher.run(train_argv(tmp_path / "run", warmup.parent))
    assert result.code == ExitCode.USER_ERROR, result.stderr[-3000:]
    line = error_line(result.stderr)
    assert line.startswith(f"podsrl: error: {weights}: damaged weights (")
    assert line.endswith(f"it is a cached warm-up: delete {warmup} and the next run (or `podsrl warmup`) trains "
                         "it again")


def test_all_checkpoints_damaged_stops_the_resume_and_eval_names_the_file(tmp_path, launcher, warm_cache):
    run = tmp_path / "run"
    assert launcher.run(train_argv(run, warm_cache, **{"train.max_steps": 2})).code == ExitCode.FINISHED
    (checkpoint,) = list_checkpoints(run)
    weights = checkpoint / "model" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:100])
    result = launcher.run([*resume_argv(run), "train.max_steps=4"])
    assert result.code == ExitCode.USER_ERROR, result.stderr[-3000:]
    assert error_line(result.stderr) == (
        f"podsrl: error: --resume: no checkpoint of {run} is intact; the newest, {checkpoint}: "
        f"model/model.safetensors has 100 bytes, {size} expected (truncated or overwritten). Restore its files "
        f"from a copy, or move {run / 'checkpoints'} away to train the run again from step 0")
    assert list_checkpoints(run) == [checkpoint] and latest_checkpoint(run) is None  # kept for repair, not pruned
    result = launcher.run(["eval", "--config", "grpo", *tiny(run, warm_cache), "--model", str(checkpoint / "model")])
    assert result.code == ExitCode.USER_ERROR, result.stderr[-3000:]
    line = error_line(result.stderr)
    assert line.startswith(f"podsrl: error: {weights}: damaged weights (") and "it is a run's checkpoint" in line

