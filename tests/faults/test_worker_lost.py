"""A Ray worker killed under a run with rollout.engine_options.max_retries=0: the run ends with one line naming
the worker, its work and the step, no traceback, and exit code WORKER_LOST; its checkpoints stay resumable."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from podsrl.exit_codes import ExitCode
from tests.faults.common import error_line, train_argv, wait_for_step

pytest.importorskip("ray")


def _ray_workers(tag: str) -> list[int]:
    """The pids of the Ray worker processes started for the run whose environment carries `tag` (Ray's processes
    inherit the driver's environment): only this test's own."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or not (proc / "cmdline").read_bytes().startswith(b"ray::RolloutWorker"):
                continue
            if f"PODSRL_TEST_TAG={tag}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return sorted(pids)


def test_a_killed_ray_worker_without_retries_ends_the_run_with_one_named_line(tmp_path, launcher, warm_cache):
    run, tag = tmp_path / "run", uuid.uuid4().hex
    child = launcher.start(train_argv(run, warm_cache, **{
        "rollout.engine": "ray", "rollout.engine_options": "{num_workers: 2, num_cpus: 2, max_retries: 0}",
        "train.save_every": 1}), env={"PODSRL_TEST_TAG": tag, "SPREAD_SLEEP": "0.5"})
    wait_for_step(run, 1, child, timeout=300)
    deadline = time.monotonic() + 60
    while not (workers := _ray_workers(tag)):
        assert time.monotonic() < deadline, "no Ray worker of the run found"
        time.sleep(0.2)
    os.kill(workers[0], signal.SIGKILL)
    result = child.wait(timeout=300)
    assert result.code == ExitCode.WORKER_LOST, result.stderr[-3000:]
    line = error_line(result.stderr)  # and no traceback anywhere
    assert line.startswith("podsrl: error: after step ") and ": ray engine: worker " in line, line
    assert ", failed 1 times, the bound set by rollout.engine_options.max_retries=0; last error: " in line, line
    assert line.endswith(f"`podsrl train --resume {run}` continues from its last checkpoint"), line
    assert not (run / "summary.json").exists()  # not reported as finished
