"""The multi-node launch (examples/slurm/node.sh, docs/scale.md "Multi-node") on one machine: two torchrun "nodes" of
one gloo rank each, joined by a c10d rendezvous on localhost, train with the Ray rollout pool on a cluster started with
`ray start --head` (every rank joins it by address: the config's `address: auto` reads RAY_ADDRESS). One node's rank
is SIGKILLed at step 3, which ends the job on both; the same command run again on both nodes (a requeue) resumes from
step 2's checkpoint and finishes. Across the "nodes": one rank writes (metrics once per step, the checkpoints, the
config, the summary, run.log), the other logs to ranks/rank1.log, the run lock is free after the kill, the pool's
engine was Ray's; the Ray cluster is stopped at the end (its `ray start --block` process group, nothing else)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from podsrl.reporting.tracking import read_metrics
from podsrl.run.checkpoint import latest_checkpoint, list_checkpoints
from tests.faults.common import tiny

ROOT = Path(__file__).resolve().parents[2]
NODE = ROOT / "examples" / "slurm" / "node.sh"
STEPS = 4  # checkpoints every 2 (tiny's train.save_every)
# Ray 2.5x turns token authentication on for `ray start`; a cluster of its own on one machine does without (on a real
# cluster the drivers read the cluster's token: examples/slurm/train.sbatch)
RAY_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
pytestmark = [pytest.mark.cpu_only("gloo ranks and a Ray cluster on this machine"), pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def ray_cluster():
    """`ray start --head --block` on localhost in a session of its own, with ports of its own (other Ray clusters on
    the machine are left alone); its address; stopped by signalling that session only."""
    pytest.importorskip("ray")
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    cmd = [ray_bin(), "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
           "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
           f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
           f"--ray-client-server-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=RAY_ENV)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not answers(address):
            assert head.poll() is None, head.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not come up in 300 s"
            time.sleep(2)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops what it started; its session, nothing else
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    assert not answers(address), "the Ray cluster still answers after it was stopped"


def answers(address: str) -> bool:
    return subprocess.run([ray_bin(), "status", f"--address={address}"], capture_output=True, env=RAY_ENV,
                          timeout=120).returncode == 0


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> str:
    from podsrl.config import load_config
    from podsrl.run.warmup import run_warmup

    cache = tmp_path_factory.mktemp("warm")
    run_warmup(load_config(None, tiny(tmp_path_factory.mktemp("unused"), cache)), progress=False)
    return str(cache)


def launch(run: Path, warm: str, address: str, rdzv_port: int, attempt: str,
           faults: dict[int, str] | None = None) -> list[subprocess.CompletedProcess]:
    """examples/slurm/node.sh on two "nodes" at once (one rank each), as a Slurm job's srun would start it on each
    node; `faults` injects PODSRL_FAULTS into one node's rank."""
    overrides = tiny(run, warm, **{"train.max_steps": STEPS, "log.rank_logs": "true", "rollout.engine": "ray",
                                   "rollout.engine_options": "{address: auto, num_workers: 1, cpus_per_worker: 1}"})
    overrides = [o for o in overrides if not o.startswith("output_dir=")]  # node.sh sets it from RUN_DIR
    env = {**RAY_ENV, "NNODES": "2", "HEAD": "127.0.0.1", "NPROC_PER_NODE": "1", "RUN_DIR": str(run),
           "RDZV_PORT": str(rdzv_port), "RDZV_ID": attempt, "PYTHON": sys.executable, "RAY_ADDRESS": address,
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    nodes = [subprocess.Popen(["bash", str(NODE), "--config", "grpo", *overrides], cwd=ROOT,
                              env={**env, **({"PODSRL_FAULTS": faults[n]} if faults and n in faults else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    done = []
    for node in nodes:
        out, err = node.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return done


def test_two_nodes_train_with_a_ray_cluster_and_resume_both_after_one_is_killed(tmp_path, warm, ray_cluster):
    run = tmp_path / "run"
    killed = launch(run, warm, ray_cluster, free_port(), "first", faults={1: "kill@step:3"})
    assert all(node.returncode != 0 for node in killed), [node.stderr[-2000:] for node in killed]
    assert latest_checkpoint(run).name == "step-00000002"
    assert (run / "config.yaml").is_file()  # what the relaunch resumes with

    resumed = launch(run, warm, ray_cluster, free_port(), "requeued")
    assert all(node.returncode == 0 for node in resumed), [node.stderr[-3000:] for node in resumed]
    writer = [node for node in resumed if "resumed" in node.stderr]  # global rank 0: on either node
    assert len(writer) == 1 and "at step 2" in writer[0].stderr
    assert "ranks (torchrun, gloo)" in writer[0].stderr  # the start-up line: 2 ranks, one writer

    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "reward" in r]
    assert steps == list(range(1, STEPS + 1))  # step 3's record from the killed attempt replaced, none twice
    assert [p.name for p in list_checkpoints(run)] == ["step-00000002", "step-00000004"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == STEPS and summary["engine"] == "ray"
    assert (run / "run.log").is_file() and "resumed" in (run / "run.log").read_text()
    assert (run / "ranks" / "rank1.log").is_file()
    assert not list((run / "checkpoints").glob(".tmp-*"))
