"""Episodes under torchrun: the episode task (arithmetic with a calculator) on 2 gloo ranks, killed while step 3's
episodes are in flight and resumed on 2 ranks, equals the one-process run: the same episodes (episode/* metrics
equal), the update's numbers to float rounding, as for single-turn runs (test_distributed.py). Each rank samples its
share of every turn's rows through the sharded engine; the shares are gathered before the environments step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from podsrl.config import load_config
from tests.faults.common import tiny
from tests.faults.test_episodes_resume import EPISODES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only("two gloo ranks on CPU (torchrun)")]


def _train(run: Path, cache: Path, ranks: int, faults: str = "", resume: bool = False) -> int:
    args = ["--resume", str(run)] if resume else ["--config", "grpo", *tiny(run, cache, **EPISODES, **{
        "model.device": "cpu", "train.max_steps": 4, "train.save_every": 2, "train.eval_every": 2})]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)
                ] if ranks > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PODSRL_FAULTS": faults} if faults else \
        {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, "-m", "podsrl", "train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert (proc.returncode != 0) == bool(faults), proc.stderr[-3000:]
    return proc.returncode


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_killed_with_episodes_in_flight_resume_to_the_one_process_run(tmp_path):
    from podsrl.run.warmup import run_warmup

    cache = tmp_path / "warm"  # trained once here, read by every run
    run_warmup(load_config(None, tiny(tmp_path / "unused", cache, **EPISODES)), progress=False)
    _train(tmp_path / "one", cache, 1)
    _train(tmp_path / "two", cache, 2, faults="kill@turn:3")  # every rank dies after step 3's first turn
    assert [r["step"] for r in _records(tmp_path / "two") if "reward" in r] == [1, 2]
    _train(tmp_path / "two", cache, 2, resume=True)
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1, 2, 2, 3, 4, 4]
    steps = [r for r in one if "reward" in r]
    assert all(r["episode/turns"] > 1 and r["episode/tool_calls/calculator"] > 0 for r in steps)
    assert all(r["grad_norm"] > 0 for r in steps)  # real updates
    for a, b in zip(one, two):
        assert {k: v for k, v in a.items() if k.startswith("episode/")} == \
               {k: v for k, v in b.items() if k.startswith("episode/")}, a["step"]
        for k, v in a.items():
            if not k.startswith("time/") and isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-5), (a["step"], k)
