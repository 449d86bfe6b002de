"""Torch threads are decided once at start-up from the run and the machine (podsrl/threads.py): the usable cores
shared among the run's processes on this machine, OMP_NUM_THREADS and train.threads first; waiting threads sleep."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from podsrl.config import load_config
from podsrl.config.presets import preset_path
from podsrl.errors import UserError
from podsrl.threads import choose_threads
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


def config(*overrides):
    return load_config(preset_path("default"), list(overrides))


def test_the_default_run_takes_the_usable_cores():
    for cores in (1, 2, 16):
        choice = choose_threads(config(), cores, {})
        assert choice.threads == cores and f"{cores} usable cores" in choice.line()


def test_the_cores_are_shared_among_the_runs_processes():
    hf = config("model.name_or_path=some/model")
    assert choose_threads(hf, 8, {}).threads == 8
    assert choose_threads(hf, 8, {"LOCAL_WORLD_SIZE": "2"}).threads == 4  # torchrun: 2 ranks on this node
    assert choose_threads(hf, 2, {"LOCAL_WORLD_SIZE": "4"}).threads == 1
    ray = config("model.name_or_path=some/model", "rollout.engine=ray",
                 "rollout.engine_options={num_workers: 2, cpus_per_worker: 2}")
    assert choose_threads(ray, 8, {}).threads == 4  # the local Ray workers take 4 of the 8 cores
    assert choose_threads(ray, 4, {}).threads == 1
    defaults = config("model.name_or_path=some/model", "rollout.engine=ray")  # 2 workers of 1 core: the engine's own
    assert choose_threads(defaults, 8, {}).threads == 6
    cluster = config("model.name_or_path=some/model", "rollout.engine=ray", "rollout.engine_options={address: auto}")
    assert choose_threads(cluster, 8, {}).threads == 8  # its workers run on the cluster's machines


def test_omp_num_threads_then_the_config_key_override_the_choice():
    assert choose_threads(config("train.threads=3"), 2, {}).threads == 3
    choice = choose_threads(config("train.threads=3"), 2, {"OMP_NUM_THREADS": "2"})
    assert choice.threads == 2 and "OMP_NUM_THREADS=2" in choice.line()
    with pytest.raises(UserError, match="OMP_NUM_THREADS='two'"):
        choose_threads(config(), 2, {"OMP_NUM_THREADS": "two"})


def test_podsrl_train_logs_its_choice_and_sets_the_wait_policy_before_torch(tmp_path, warmup_cache):
    """As a program, the CLI sets OMP_WAIT_POLICY before torch loads OpenMP and logs its choice once (the test
    process's own OMP_NUM_THREADS, if any, is removed so that the choice is podsrl's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    probe = "import os, podsrl.cli, torch; print(os.environ['OMP_WAIT_POLICY'])"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "PASSIVE"
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{"train.max_steps": 1})
    done = subprocess.run([sys.executable, "-m", "podsrl", "train", "--config", "grpo", *overrides],
                          env=env, capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "threads:" in line]
    cores = len(os.sched_getaffinity(0))
    assert len(lines) == 1 and f"{cores} usable cores" in lines[0], lines
