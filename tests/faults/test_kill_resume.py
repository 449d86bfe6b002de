"""Crash safety: SIGKILL anywhere (inside each phase of a checkpoint write, or at random wall times), SIGTERM and
SIGINT; after `--resume` the run must equal the uninterrupted one exactly (every non-time metric of every record,
and the final weights), and no kill may cost more than one checkpoint interval of steps."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

from podsrl.exit_codes import ExitCode
from podsrl.run.checkpoint import latest_checkpoint, list_checkpoints
from tests.faults.common import (
    MAX_STEPS,
    SAVE_EVERY,
    assert_same_run,
    last_step,
    resume_argv,
    train_argv,
    wait_for_step,
)


def _resume_step(run: Path) -> int:
    path = latest_checkpoint(run)
    return int(path.name.removeprefix("step-")) if path else 0


def _argv(run: Path, cache: str) -> list[str]:
    """Fresh until the run has written its config (like the compare runner), then --resume."""
    return resume_argv(run) if (run / "config.yaml").is_file() else train_argv(run, cache)


def _killed(run: Path, result) -> int:
    """Checks a SIGKILLed attempt and returns the steps it lost (done but not in any good checkpoint)."""
    assert result.code == -signal.SIGKILL, result.stderr[-3000:]
    lost = last_step(run) - _resume_step(run)
    assert 0 <= lost <= SAVE_EVERY, f"lost {lost} steps (last logged {last_step(run)}, resume {_resume_step(run)})"
    return lost


def _summary(run: Path) -> dict:
    return {k: v for k, v in json.loads((run / "summary.json").read_text()).items() if not k.startswith("time/")}


def test_kill_inside_each_checkpoint_phase(tmp_path, launcher, warm_cache, reference_run):
    run = tmp_path / "run"
    plan = ["kill@ckpt_begin:2", "kill@ckpt_model:2", "kill@ckpt_manifest:2", "kill@ckpt_rename:2",
            "kill@ckpt_prune:4", "kill@ckpt_rename:6", "kill@ckpt_prune:6"]
    for faults in plan:
        _killed(run, launcher.run(_argv(run, warm_cache), env={"PODSRL_FAULTS": faults}))
        site = faults.split("@")[1].split(":")[0]
        if site in ("ckpt_prune",):  # renamed into place before the kill: that checkpoint is the one to resume
            assert _resume_step(run) == int(faults.rsplit(":", 1)[1])
    assert not (run / "summary.json").exists()
    result = launcher.run(resume_argv(run))  # checkpoint 6 is complete: nothing left but the summary
    assert result.code == 0, result.stderr[-3000:]
    assert_same_run(run, reference_run)
    assert _summary(run) == _summary(reference_run)
    # Killed before pruning, so step 2 outlived keep_checkpoints=2; nothing half-written is left behind.
    assert [p.name for p in list_checkpoints(run)] == ["step-00000002", "step-00000004", "step-00000006"]
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_sigkill_at_random_times(tmp_path, launcher, warm_cache, reference_run):
    run = tmp_path / "run"
    rng = random.Random(2024)
    kills = 0
    # Each attempt is killed at a random moment *after* a random step of its own is logged, so the kills land
    # mid-run however fast the machine is (a pure wall-clock delay let a fast machine finish early).
    while kills < 6:
        child = launcher.start(_argv(run, warm_cache), env={"SPREAD_SLEEP": "0.1"})
        start = last_step(run)  # records of the killed attempt stay in the file until the child rewrites it
        target = min(MAX_STEPS - 1, start + rng.randint(1, SAVE_EVERY + 1))
        wait_for_step(run, target, child)
        time.sleep(rng.uniform(0.0, 0.08))
        child.signal(signal.SIGKILL)
        result = child.wait()
        if result.code == 0:  # finished in the sleep before the kill landed
            break
        _killed(run, result)
        kills += 1
        with open(run / "metrics.jsonl", "a") as f:  # as if killed inside a write: a torn last line
            f.write('{"step": 99, "rew')
    assert kills >= 5
    if not (run / "summary.json").exists():
        assert launcher.run(_argv(run, warm_cache)).code == 0
    assert_same_run(run, reference_run)
    assert _summary(run) == _summary(reference_run)


def test_sigterm_and_sigint_save_exit_resumable_and_resume(tmp_path, launcher, warm_cache, reference_run):
    run = tmp_path / "run"
    # Injected SIGTERM at the start of step 4 (not a save or eval step): that step finishes, is checkpointed at
    # once without an extra eval record, and the process exits with the resumable code, so a scheduler that
    # requeues failed jobs requeues it (exit 0 would read as finished).
    result = launcher.run(train_argv(run, warm_cache), env={"PODSRL_FAULTS": "term@step:4"})
    assert result.code == ExitCode.STOPPED_RESUMABLE == 75, result.stderr[-3000:]
    assert f"stopped by signal at step 4; resume with --resume {run}" in result.stderr
    assert "Traceback" not in result.stderr
    assert _resume_step(run) == last_step(run) == 4
    assert not (run / "summary.json").exists()
    # A real SIGINT from outside (Ctrl-C) while training: same outcome at whatever step was in flight.
    child = launcher.start(resume_argv(run), env={"SPREAD_SLEEP": "0.2"})  # paced: the signal lands mid-run
    wait_for_step(run, 5, child)
    child.signal(signal.SIGINT)
    result = child.wait()
    if last_step(run) < 6:  # the signal landed before the last step: resumable
        assert result.code == ExitCode.STOPPED_RESUMABLE, result.stderr[-3000:]
        assert _resume_step(run) == last_step(run)
        assert launcher.run(resume_argv(run)).code == ExitCode.FINISHED
    else:  # it landed in the last step: the run is finished, whatever stopped it
        assert result.code == ExitCode.FINISHED, result.stderr[-3000:]
    assert_same_run(run, reference_run)
    assert _summary(run) == _summary(reference_run)
    # A requeued job of the finished run: one line, exit 0, nothing trained or rewritten.
    before = (run / "metrics.jsonl").read_bytes()
    result = launcher.run(resume_argv(run))
    assert result.code == ExitCode.FINISHED, result.stderr[-3000:]
    assert result.stdout.strip() == f"podsrl: {run} is finished (step 6, summary.json); nothing to resume"
    assert (run / "metrics.jsonl").read_bytes() == before


def test_second_sigint_aborts_and_loses_at_most_the_steps_since_the_checkpoint(
        tmp_path, launcher, warm_cache, reference_run):
    run = tmp_path / "run"
    # First Ctrl-C at step 3 asks for a checkpoint; the second, arriving while it is written, aborts at once.
    result = launcher.run(train_argv(run, warm_cache), env={"PODSRL_FAULTS": "int@step:3 int@ckpt_model:3"})
    assert result.code == 130, result.stderr[-3000:]
    assert result.stderr.rstrip().splitlines()[-1] == "podsrl: interrupted"
    assert "Traceback" not in result.stderr
    assert _resume_step(run) == 2
    assert launcher.run(resume_argv(run)).code == 0
    assert_same_run(run, reference_run)


def test_sigterm_during_warmup_exits_cleanly_and_caches_nothing(tmp_path, launcher):
    cache = tmp_path / "cache"
    # No early stop at a target accuracy: on a fast machine the default target is met within the first 1.5 s.
    child = launcher.start(train_argv(tmp_path / "run", cache, **{"warmup.steps": 100000, "warmup.target_accuracy": 0}))
    time.sleep(1.5)  # well inside a warm-up of 100000 steps
    assert child.poll() is None, child.stderr()
    child.signal(signal.SIGTERM)
    result = child.wait()
    assert result.code == 130
    assert result.stderr.rstrip().splitlines()[-1] == "podsrl: interrupted"
    assert "Traceback" not in result.stderr
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))
