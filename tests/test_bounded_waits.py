"""Every wait on another process or thread is bounded (podsrl/waits.py, train.wait_timeout_s): each kind is hung on
purpose here (a generator thread that blocks, a gloo rank that never joins, a Ray worker that sleeps, vLLM's
workers that do not answer) and the run stops within the bound with one line naming what it waited for and where;
a run stopped so exits with ExitCode.STALLED."""

from __future__ import annotations

import threading
import time

import pytest

from podsrl import waits
from podsrl.cli import main
from podsrl.exit_codes import ExitCode
from podsrl.run import producer
from podsrl.run.async_generation import BackgroundGenerator
from tests.conftest import tiny_overrides
from tests.test_async_generation import SyncOnly, updates_model

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
