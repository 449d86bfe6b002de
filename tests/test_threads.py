"""Torch threads are decided at start-up from the run and the machine (podsrl/threads.py): the usable cores shared
among the run's processes on this machine, OMP_NUM_THREADS and train.threads first; podsrl's own choice is then fitted
at each step to the cores other runnable work leaves free; a count the user fixed waits asleep."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from podsrl import threads
from podsrl.config import load_config
from podsrl.config.presets import preset_path
from podsrl.errors import UserError
from podsrl.threads import STEPS_TO_CHANGE, ThreadFitter, choose_threads, runnable_elsewhere
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
    """As a program, the CLI leaves OpenMP's wait policy alone when it fits the threads to the load, sets it to
    sleep before torch loads OpenMP when OMP_NUM_THREADS fixes the count, and logs its choice once (the test
    process's own OMP_NUM_THREADS, if any, is removed so that the choice is podsrl's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    probe = "import os, podsrl.cli, torch; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"
    for threads_env, policy in (({}, "unset"), ({"OMP_NUM_THREADS": "2"}, "PASSIVE")):
        assert subprocess.run([sys.executable, "-c", probe], env={**env, **threads_env}, capture_output=True,
                              text=True, check=True).stdout.strip() == policy
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{"train.max_steps": 1})
    done = subprocess.run([sys.executable, "-m", "podsrl", "train", "--config", "grpo", *overrides],
                          env=env, capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "threads:" in line]
    cores = len(os.sched_getaffinity(0))
    assert len(lines) == 1 and f"{cores} usable cores" in lines[0], lines


class Machine:
    """Other runnable tasks as a fake /proc would report them, and the thread counts set."""

    def __init__(self, others):
        self.others, self.set = list(others), []

    def fitter(self, most=2, cores=2):
        return ThreadFitter(most, cores, self.set.append, others=lambda: self.others.pop(0), clock=lambda: 0.0)


def test_threads_follow_the_free_cores_once_two_steps_in_a_row_call_for_it():
    assert STEPS_TO_CHANGE == 2
    machine = Machine([0, 1, 0, 1, 1, 0, 1, 1, 0, 0, 3, 3])
    fitter = machine.fitter()
    seen = [fitter.at_step() for _ in range(len(machine.others))]
    # idle: 2; a task seen in one step only: still 2; one competitor two steps in a row: 1; free once, then busy
    # again: still 1; free two steps: 2; three competitors on two cores: 1 (never 0)
    assert seen == [2, 2, 2, 2, 1, 1, 1, 1, 1, 2, 2, 1]
    assert machine.set == [1, 2, 1]


def test_threads_move_to_the_least_room_the_steps_showed():
    machine = Machine([6, 6, 2, 4])
    fitter = machine.fitter(most=8, cores=8)
    assert [fitter.at_step() for _ in range(4)] == [8, 2, 2, 4]
    assert machine.set == [2, 4]


def test_runnable_elsewhere_leaves_out_this_process_own_running_threads(tmp_path, monkeypatch):
    proc = tmp_path / "proc"
    (proc / "self" / "task").mkdir(parents=True)
    (proc / "loadavg").write_text("3.10 2.50 2.00 4/611 12345\n")
    for tid, state in ((1, "R"), (2, "S"), (3, "R")):
        (proc / "self" / "task" / str(tid)).mkdir()
        (proc / "self" / "task" / str(tid) / "stat").write_text(f"{tid} (pt_main thread) {state} 1 1 1 0 -1\n")
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    assert runnable_elsewhere(str(proc)) == 2  # 4 running on the machine, 2 of them this process's threads
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)
    assert runnable_elsewhere(str(proc)) == 1  # half the machine's cores are usable: half the others on them
    assert runnable_elsewhere() >= 0  # the real /proc reads


@pytest.mark.parametrize("env, overrides, fitted", [
    ({}, (), True),
    ({"OMP_NUM_THREADS": "2"}, (), False),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, (), False),
    ({}, ("train.threads=2",), False),
    ({}, ("train.async.enabled=true",), False),
])
def test_only_podsrls_own_choice_is_fitted_to_the_load(env, overrides, fitted, monkeypatch):
    import torch

    set_to = []
    monkeypatch.setattr(threads, "runnable_elsewhere", lambda: 5)  # more other work than cores
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(threads, "_fitter", None)  # restored after the test, as the rest is
    threads.apply_threads(config(*overrides), env)
    for _ in range(STEPS_TO_CHANGE):
        threads.fit_threads_to_load()
    assert set_to == ([2, 1] if fitted else [2])  # the start-up choice, then 1 thread beside the other work


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroups_cpu_quota_bounds_the_usable_cores(tmp_path, monkeypatch):
    """A container's CPU limit (cgroup v2 cpu.max, v1 cfs quota), the tightest of the process's cgroup and its
    parents, caps the threads: 8 cores in the affinity mask under a 1.5-CPU limit give 1 thread, not 8."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "self" / "cgroup", "0::/kubepods/pod1/c1\n")
    write(root / "kubepods" / "cpu.max", "max 100000\n")
    write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    write(root / "kubepods" / "pod1" / "c1" / "cpu.max", "max 100000\n")
    assert threads.cpu_quota(str(proc), str(root)) == 1.5
    write(proc / "self" / "cgroup", "0::/\n")  # inside the container's cgroup namespace: its cgroup is the root
    write(root / "cpu.max", "400000 100000\n")
    assert threads.cpu_quota(str(proc), str(root)) == 4.0
    write(root / "cpu.max", "max 100000\n")
    assert threads.cpu_quota(str(proc), str(root)) is None
    v1 = tmp_path / "v1"  # cgroup v1: the cpu controller's own hierarchy
    write(proc / "self" / "cgroup", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    write(v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "300000\n")
    write(v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert threads.cpu_quota(str(proc), str(v1)) == 3.0
    write(v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n")
    assert threads.cpu_quota(str(proc), str(v1)) is None
    assert threads.cpu_quota(str(tmp_path / "no_proc"), str(root)) is None

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    for quota, cores in ((None, 8), (1.5, 1), (0.5, 1), (4.0, 4), (16.0, 8)):
        monkeypatch.setattr(threads, "cpu_quota", lambda q=quota: q)
        assert threads.usable_cores() == cores
