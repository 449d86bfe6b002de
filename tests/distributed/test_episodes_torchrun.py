"""Episodes under torchrun. Each of 2 gloo ranks samples its share of every turn's rows through the sharded engine
(each episode on the rank that sampled its first turn), the shares gathered before the environments step, and the
episodes equal one process's. The episode task (arithmetic
with a calculator) on 2 ranks, killed while step 3's episodes are in flight and resumed on 2 ranks, equals the
one-process run: the same episodes (episode/* metrics equal), the update's numbers to float rounding, as for
single-turn runs (test_distributed.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from podsrl.batch import Problem
from podsrl.config import load_config
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask
from tests.episodes.scripted import EOS_TEXT, ScriptedEngine
from tests.episodes.test_runner import calculator_script, run
from tests.faults.common import EPISODES, tiny

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only("two gloo ranks on CPU (torchrun)")]


def _calls_on_odd_seeds(context: str, seed: int) -> str:
    """Turns of odd seeds call the calculator (and then answer with its result), the others answer at once: only
    some episodes live on to a second turn."""
    return calculator_script(context, seed) if seed % 2 else "7" + EOS_TEXT


def _episodes(engine):
    problems = [Problem(uid=f"p{i}", prompt=f"{i + 2}+{i + 5}=", answer=str(2 * i + 7)) for i in range(3)]
    return run(engine, ArithmeticToolTask(seed=0, eval_size=0), problems, [3, 2, 2], list(range(10, 17)))


def _episode_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from podsrl.distributed import init_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    engine = ScriptedEngine(_calls_on_odd_seeds)
    out = _episodes(init_distributed(torch.device("cpu")).wrap_engine(engine))
    torch.save({"out": out, "rows": [len(c["contexts"]) for c in engine.calls]}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_each_rank_samples_its_share_of_each_turn_and_the_episodes_equal_one_process(tmp_path):
    mp.spawn(_episode_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    engine = ScriptedEngine(_calls_on_odd_seeds)
    single = _episodes(engine)
    turns = [len(c["contexts"]) for c in engine.calls]
    assert turns[0] == 7 and 0 < turns[1] < 7  # every episode's first turn, then the callers' next
    # the rows of each turn split between the ranks (each episode on the rank of its first turn), none sampled twice
    assert [a + b for a, b in zip(ranks[0]["rows"], ranks[1]["rows"])] == turns
    assert sorted(r["rows"][0] for r in ranks) == [3, 4]
    for r in ranks:
        out = r["out"]
        for f in ("group_index", "prompt_ids", "completion_ids", "completion_mask", "truncated", "logprobs"):
            assert torch.equal(getattr(out.generation, f), getattr(single.generation, f)), f
        assert torch.equal(out.loss_mask, single.loss_mask) and out.stats == single.stats


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
