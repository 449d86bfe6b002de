"""FSDP2 end to end under torchrun (2 ranks, gloo): a run SIGKILLed while writing a sharded checkpoint resumes to
exactly the uninterrupted run (every non-time metric, the final weights), and the checkpoint's `model/` loads in
transformers and computes what the trainer's weights compute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from podsrl.run.checkpoint import latest_checkpoint, list_checkpoints
from tests.faults.common import assert_same_run, tiny

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
pytestmark = pytest.mark.cpu_only("two gloo ranks under torchrun")


def torchrun(run: Path, cache: str | None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 -m podsrl train` of the tiny fault-test run with FSDP2 and a KL reference."""
    args = ["--resume", str(run)] if cache is None else [
        "--config", "grpo", *tiny(run, cache, **{"train.max_steps": STEPS, "train.strategy": "fsdp",
                                                  "algo.beta": 0.05, "optim.mini_batches": 2})]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "podsrl", "train", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> str:
    from podsrl.config import load_config
    from podsrl.run.warmup import run_warmup

    cache = tmp_path_factory.mktemp("warm")
    run_warmup(load_config(None, tiny(tmp_path_factory.mktemp("unused"), cache)), progress=False)
    return str(cache)


@pytest.mark.slow
def test_fsdp_kill_during_sharded_save_then_resume_equals_uninterrupted(tmp_path, warm):
    reference, run = tmp_path / "reference", tmp_path / "run"
    done = torchrun(reference, warm)
    assert done.returncode == 0, done.stderr[-3000:]
    # Killed after every rank wrote its shards of step 4, before the manifest: that checkpoint must not count.
    killed = torchrun(run, warm, env={"PODSRL_FAULTS": "kill@ckpt_manifest:4"})
    assert killed.returncode != 0
    assert latest_checkpoint(run).name == "step-00000002"
    assert list((run / "checkpoints").glob(".tmp-step-00000004-*/sharded/__1_0.distcp"))
    resumed = torchrun(run, None)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stderr
    assert_same_run(run, reference)  # every non-time metric of every record, and the final weights
    final = latest_checkpoint(run)
    assert final.name == f"step-{STEPS:08d}" and not list((run / "checkpoints").glob(".tmp-*"))
    assert sorted(p.name for p in (final / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert [p.name for p in list_checkpoints(run)] == ["step-00000002", "step-00000004"]
    assert_export_equals_shards(final)


def assert_export_equals_shards(path: Path) -> None:
    """The checkpoint's model/ loads in plain transformers (no podsrl, no peft) and equals the sharded master
    weights, read back in this one process without a process group."""
    from transformers import AutoModelForCausalLM

    from podsrl.run.checkpoint import load_sharded_tensors

    model = AutoModelForCausalLM.from_pretrained(path / "model")
    exported = model.state_dict()
    tied = model.config.tie_word_embeddings
    shards = {"model": {k: torch.empty_like(v) for k, v in exported.items() if not (tied and k == "lm_head.weight")}}
    load_sharded_tensors(shards, path / "sharded")
    assert all(torch.equal(shards["model"][k], exported[k]) for k in shards["model"])
    assert torch.isfinite(model(input_ids=torch.arange(3, 11)[None]).logits).all()
