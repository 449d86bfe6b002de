"""Every wait on another process or thread is bounded (podsrl/waits.py, train.wait_timeout_s): each kind is hung on
purpose here (a generator thread that blocks, a gloo rank that never joins, a Ray worker that sleeps, vLLM's
workers that do not answer) and the run stops within the bound with one line naming what it waited for and where;
a run stopped so exits with ExitCode.STALLED."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from podsrl import waits
from podsrl.cli import main
from podsrl.distributed import init_distributed
from podsrl.exit_codes import ExitCode
from podsrl.run import producer
from podsrl.run.async_generation import BackgroundGenerator
from tests.conftest import tiny_overrides
from tests.engines.test_vllm_contract import engine as vllm_engine
from tests.engines.test_vllm_contract import tiny_model, vllm  # noqa: F401 (vllm: the fake's fixture)
from tests.run.test_async_generation import SyncOnly, updates_model

BOUND = 1.0  # seconds: small, so each hang is seen quickly


@pytest.fixture
def small_bound():
    waits.configure(BOUND)
    yield
    waits.configure(waits.DEFAULT_S)
    waits.at_step(None)


def test_the_learner_stops_waiting_for_a_generator_thread_that_blocks(small_bound):
    release = threading.Event()
    generator = BackgroundGenerator(lambda step: release.wait(), updates_model(), SyncOnly(), 1, 0, 5)
    waits.at_step(1)
    t0 = time.perf_counter()
    with pytest.raises(waits.WaitExpired) as expired:
        generator.take(0)
    assert BOUND <= time.perf_counter() - t0 < BOUND + 1.0
    assert str(expired.value) == ("waited train.wait_timeout_s=1 s for step 0's batch (the async generator thread, "
                                  "podsrl-generator, step 1) and got no answer")
    t0 = time.perf_counter()
    generator.close()  # the stalled thread is left behind: no second wait
    assert time.perf_counter() - t0 < 0.5
    release.set()


def test_a_run_whose_generator_thread_blocks_stops_with_one_line_and_exit_code_stalled(tmp_path, warmup_cache,
                                                                                         monkeypatch, capsys):
    release = threading.Event()
    produce = producer.BatchProducer.produce

    def blocks_in_the_generator_thread(self, step):
        if threading.current_thread().name == "podsrl-generator":
            release.wait()
        return produce(self, step)

    monkeypatch.setattr(producer.BatchProducer, "produce", blocks_in_the_generator_thread)
    overrides = tiny_overrides(tmp_path, warmup_cache, **{"train.async.enabled": True, "train.max_steps": 3,
                                                          "train.wait_timeout_s": BOUND})
    try:
        assert main(["train", "--config", "grpo", *overrides]) == ExitCode.STALLED
    finally:
        release.set()
        waits.configure(waits.DEFAULT_S)
        waits.at_step(None)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("podsrl: stalled: waited train.wait_timeout_s=1 s for step 0's batch (the async generator "
                       "thread, podsrl-generator, step 1) and got no answer"), err


def _rank(rank: int, port: int, out: str) -> None:
    """A 2-rank gloo job joined as the trainer joins it (its bound set first); rank 1 never joins rank 0's
    broadcast of a decision."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    waits.configure(BOUND)
    ctx = init_distributed(torch.device("cpu"))
    if rank == 1:
        time.sleep(BOUND + 3)
        return
    waits.at_step(7)
    t0 = time.perf_counter()
    try:
        ctx.agree(True)
        line = "joined"
    except waits.WaitExpired as e:
        line = str(e)
    Path(out).write_text(json.dumps({"line": line, "seconds": time.perf_counter() - t0}))


def test_a_collective_a_rank_never_joins_stops_within_the_bound(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.json"
    mp.spawn(_rank, args=(port, str(out)), nprocs=2, join=True)
    seen = json.loads(out.read_text())
    assert seen["line"] == ("waited train.wait_timeout_s=1 s for the other ranks in broadcast of rank 0's decision "
                            "(agree) (rank 0 of 2, step 7) and got no answer")
    assert seen["seconds"] < BOUND + 2.0


@pytest.mark.usefixtures("vllm", "small_bound")
def test_a_weight_sync_vllms_workers_do_not_answer_stops_within_the_bound(monkeypatch):
    """vLLM's collective_rpc is called with the bound as its timeout; the TimeoutError vLLM raises when its
    workers do not answer by then (the fake's answer comes late) stops the run with the line."""
    model = tiny_model()
    eng = vllm_engine(model)
    timeouts = []

    def answers_late(method, timeout=None, args=(), kwargs=None):
        timeouts.append(timeout)
        time.sleep(timeout)
        raise TimeoutError(f"RPC call to {method} timed out.")

    monkeypatch.setattr(eng.llm, "collective_rpc", answers_late)
    t0 = time.perf_counter()
    with pytest.raises(waits.WaitExpired) as expired:
        eng.sync_weights(model)
    assert timeouts == [BOUND] and time.perf_counter() - t0 < BOUND + 1.0
    assert str(expired.value) == ("waited train.wait_timeout_s=1 s for vLLM's workers to reload the weights "
                                  "(collective_rpc reload_weights) and got no answer")
