"""Processes an environment starts are contained: a forked child that calls sys.exit ends (it is not caught as a fault
and kept alive as a copy of the trainer), processes a step leaves running are ended when their episodes are over,
with one warning naming the environment's call and their count at the end of the run, and an os._exit(0) in a step
ends `podsrl train` with a code a scheduler reads as failure, said in one line on stderr and in run.log."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from podsrl.episodes.children import process_state
from podsrl.exit_codes import ExitCode

STEPS = 3


def forking_argv(run: Path, act: str, times: int, record: Path) -> list[str]:
    overrides = {
        "output_dir": run, "task.name": "forking", "task.eval_size": 0, "warmup.steps": 0, "seed": 3,
        "task.args": f"{{act: {act}, times: {times}, record: '{record}', operands: 2, digits: 1}}",
        "method": "grpo", "model.tiny.num_layers": 1, "model.tiny.hidden_size": 32, "model.tiny.num_heads": 2,
        "model.tiny.intermediate_size": 64, "rollout.prompts_per_step": 2, "rollout.n": 2,
        "rollout.max_new_tokens": 8, "episode.max_turns": 2, "episode.max_tokens": 40, "train.max_steps": STEPS,
        "train.save_every": 1, "log.progress": False, "log.tensorboard": False, "log.plot": False,
    }
    return ["train", *(f"{k}={v}" for k, v in overrides.items())]


def running(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (a zombie left to a parent that never reaps has ended)."""
    return [pid for pid in pids if (process_state(pid) or "Z") not in "ZX"]


def started(record: Path) -> list[int]:
    return [int(line) for line in record.read_text().split()]


def end_started(record: Path) -> None:
    """A failed test leaves nothing behind."""
    for pid in running(started(record)) if record.exists() else []:
        os.kill(pid, signal.SIGKILL)


def run_finished(tmp_path: Path, launcher, act: str, times: int, wait_s: float = 0.0):
    """A finished `podsrl train` whose environment did `act` `times` times: its result and those of the processes
    the acts started that still run after at most `wait_s` (then ended, so that a failed test leaves nothing)."""
    record = tmp_path / "pids"
    result = launcher.run(forking_argv(tmp_path / "run", act, times, record), module="tests.faults.forking_envs")
    assert result.code == 0, result.stderr[-3000:]
    pids = started(record)
    assert len(pids) == times
    deadline = time.monotonic() + wait_s
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = running(pids)
    end_started(record)
    return result, left


def test_a_forked_child_that_calls_sys_exit_ends(tmp_path, launcher):
    result, left = run_finished(tmp_path, launcher, "fork_exit", 3, wait_s=10)
    assert not left, f"forked copies of the trainer still alive: {left}"
    assert "SystemExit" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]


def test_processes_a_step_leaves_running_are_ended_with_one_warning(tmp_path, launcher):
    run, record = tmp_path / "run", tmp_path / "pids"
    try:
        result = launcher.run(forking_argv(run, "leave", 6, record), module="tests.faults.forking_envs")
    finally:
        end_started(record)
    assert result.code == 0, result.stderr[-3000:]
    children = started(record)
    assert len(children) == 6
    assert not running(children), f"left running after the run: {running(children)}"
    log = (run / "run.log").read_text()
    warned = [line for line in log.splitlines() if "left" in line and "processes running" in line]
    assert len(warned) == 1 and "ForkingEnvironment.step left" in warned[0], log[-3000:]
    assert "ended over the run: ForkingEnvironment.step: 6" in log, log[-3000:]


def test_a_daemon_a_step_detaches_does_not_outlive_podsrl_train(tmp_path, launcher):
    """A double fork leaves a process that is nobody's child in the trainer (the sweeps cannot find it): as the run's
    subreaper, `podsrl train`'s supervising parent adopts it and ends it once the trainer has ended, in one line."""
    result, left = run_finished(tmp_path, launcher, "detach", 2)
    assert not left, f"detached daemons outlived the run: {left}"
    said = "2 processes the run started outlived the training process"
    assert [line for line in result.stderr.splitlines() if said in line][0].startswith("podsrl: warning: ")
    assert said in (tmp_path / "run" / "run.log").read_text().splitlines()[-1]


def test_os_exit_0_in_a_step_is_a_failure_not_a_finished_run(tmp_path, launcher):
    run, record = tmp_path / "run", tmp_path / "pids"
    result = launcher.run(forking_argv(run, "os_exit", 1, record), module="tests.faults.forking_envs")
    assert result.code == ExitCode.FAULT, result.stderr[-3000:]
    assert not (run / "summary.json").exists()
    said = "ended with exit code 0 outside podsrl's own exit, before the run finished (no summary.json)"
    assert [line for line in result.stderr.splitlines() if said in line][0].startswith("podsrl: error: ")
    assert said in (run / "run.log").read_text().splitlines()[-1]
