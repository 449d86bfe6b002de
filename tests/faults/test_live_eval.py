"""`podsrl eval` of a run being trained: the checkpoint it reads is pinned, so rotation cannot remove it while it
loads, and no pin outlives its reader."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from podsrl.exit_codes import ExitCode
from podsrl.run.checkpoint import list_checkpoints, prune_checkpoints
from podsrl.run.checkpoint_readers import pin_checkpoint
from tests.checkout import pythonpath
from tests.faults.common import error_line, tiny, train_argv, wait_for_step


def test_eval_of_a_run_saving_every_step_reads_a_checkpoint_that_stays(tmp_path, launcher, warm_cache):
    run = tmp_path / "run"
    trainer = launcher.start(train_argv(run, warm_cache, **{"train.max_steps": 10_000, "train.save_every": 1,
                                                            "train.eval_every": 10_000}))
    wait_for_step(run, 3, trainer)
    by_run, by_path = [], []
    for _ in range(5):  # eval starts again and again while the run saves (and rotates) a checkpoint every step
        result = launcher.run(["eval", "--config", "grpo", *tiny(tmp_path / "eval", warm_cache), "--model", str(run)])
        by_run.append(result)
        newest = list_checkpoints(run)[-1] / "model"
        by_path.append(launcher.run(["eval", "--config", "grpo", *tiny(tmp_path / "eval", warm_cache),
                                     "--model", str(newest)]))
    assert trainer.poll() is None, "the run ended before the evals did"
    trainer.signal(signal.SIGTERM)
    assert trainer.wait().code == ExitCode.STOPPED_RESUMABLE
    for result in by_run:
        assert result.code == ExitCode.FINISHED, result.stderr[-3000:]
        assert "eval/accuracy" in json.loads(result.stdout.strip().splitlines()[-1])
        assert "the newest complete checkpoint of" in result.stderr
    for result in by_path:  # a path named by hand is read pinned, or was removed before eval started: one line
        if result.code != ExitCode.FINISHED:
            assert result.code == ExitCode.USER_ERROR, result.stderr[-3000:]
            assert "is gone: its run removed it (train.keep_checkpoints) before this eval could pin it; pass " \
                   f"the run directory, --model {run}, to evaluate" in error_line(result.stderr)
    assert len(list_checkpoints(run)) == 2  # every pin let go: rotation back to train.keep_checkpoints


def test_rotation_keeps_a_pinned_checkpoint_and_a_dead_readers_pin_is_gone(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / "checkpoints" / f"step-{step:08d}" / "model").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step-{step:08d}" / "manifest.json").write_text("{}")
    oldest = tmp_path / "checkpoints" / "step-00000001"
    pin = pin_checkpoint(oldest)
    prune_checkpoints(tmp_path, 3, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001", "step-00000003"]
    pin.close()
    # a reader killed while it holds a pin: the OS drops its lock, the next rotation removes the checkpoint
    reader = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from podsrl.run.checkpoint_readers import pin_checkpoint; "
                               "pin = pin_checkpoint(Path(sys.argv[1])); print(pin.pinned, flush=True); "
                               "time.sleep(600)", str(oldest)], stdout=subprocess.PIPE, text=True,
                              env={"PYTHONPATH": pythonpath()})
    try:
        assert reader.stdout.readline().strip() == "True"
        prune_checkpoints(tmp_path, 3, keep=1)
        assert oldest.is_dir()  # the live reader's pin holds
    finally:
        reader.kill()
        reader.wait()
    prune_checkpoints(tmp_path, 3, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003"]
    assert pin_checkpoint(oldest) is None  # removed: a late reader finds it gone, not half there
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003"]  # nothing left behind
