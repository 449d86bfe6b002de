"""FSDP2 end to end under torchrun (2 ranks, gloo): a run SIGKILLed while writing a sharded checkpoint resumes to
exactly the uninterrupted run (every non-time metric, the final weights), and the checkpoint's `model/` loads in
transformers and computes what the trainer's weights compute; a checkpoint written by 2 ranks resumes on 3 (the
sharded state resharded) to the uninterrupted run up to float summation order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from podsrl.run.checkpoint import latest_checkpoint, list_checkpoints
from tests.faults.common import assert_same_run, final_weights, records, tiny

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
pytestmark = pytest.mark.cpu_only("two gloo ranks under torchrun")


def torchrun(run: Path, cache: str | None, env: dict | None = None, ranks: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 -m podsrl train` of the tiny fault-test run with FSDP2 and a KL reference."""
    args = ["--resume", str(run)] if cache is None else [
        "--config", "grpo", *tiny(run, cache, **{"train.max_steps": STEPS, "train.strategy": "fsdp",
                                                  "algo.beta": 0.05, "optim.mini_batches": 2})]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory, warm) -> Path:
    """The uninterrupted 2-rank run the resumed ones are compared with."""
    run = tmp_path_factory.mktemp("reference") / "run"
    done = torchrun(run, warm)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.mark.slow
def test_fsdp_kill_during_sharded_save_then_resume_equals_uninterrupted(tmp_path, warm, reference):
    run = tmp_path / "run"
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


@pytest.mark.slow
def test_fsdp_resume_on_three_ranks_reshards_the_state_and_continues_the_run(tmp_path, warm, reference):
    """A checkpoint written by 2 ranks resumes on 3: torch.distributed.checkpoint reshards the float32 masters and
    AdamW state into 3 uneven shards (hidden 32 over 3) exactly, the loop state is the ranks' common one, and with the
    fast engine's per-row seeds the rollouts are the same. The contract: the continued run equals the uninterrupted
    2-rank run up to the float summation order of the gradients' reduce-scatter over another number of ranks (every
    metric within 1e-5 relative, the final weights within 1e-5 after two AdamW steps of 1e-2: 3e-6 measured),
    not bit for bit; the resume says so in one warning."""
    run = tmp_path / "run"
    killed = torchrun(run, warm, env={"PODSRL_FAULTS": "kill@step:3"})  # after step 2's checkpoint
    assert killed.returncode != 0 and latest_checkpoint(run).name == "step-00000002"
    resumed = torchrun(run, None, ranks=3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming a checkpoint written by 2 rank(s) on 3" in resumed.stderr
    got, want = records(run), records(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] and got[-1]["step"] == STEPS
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key, value in w.items():
            assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (w["step"], key)
    a, b = final_weights(run), final_weights(reference)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a)
    assert sorted(p.name for p in (latest_checkpoint(run) / "sharded").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


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
