"""train.async with CUDA graphs: no decode-step capture beside other device work, no eval beside generation.

PyTorch allows, while a CUDA graph is being captured, no other CUDA work in the process on any thread, and one
capture at a time. Under train.async the generator thread's engine captures while the learner updates, and an eval
(the eval engine captures too) could start while the generator samples. The runs here record when each thread
captures, updates, publishes weights, evaluates and generates, and check the order. On the CPU the capture is the
decode-step tests' stand-in (each replay runs the captured operations on the memory they read); under `--device cuda` it is
the real one, and the run must also finish without a capture error.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

from podsrl.engines import fast
from podsrl.engines.decode_step import CudaGraphs, StepRunner
from podsrl.engines.fast import FastEngine
from podsrl.run import async_generation
from podsrl.run import trainer as trainer_module
from podsrl.run.trainer import Trainer
from podsrl.update import PolicyUpdater
from tests.conftest import device_under_test
from tests.engines.graph_stand_in import RecordedGraphs
from tests.faults.test_async_exact import config

ON_CUDA = device_under_test().type == "cuda"
GENERATOR = "podsrl-generator"  # the generator thread's name
ROLLOUTS_PER_STEP = 16  # tiny(): 4 prompts x 4 rollouts, PODS trains 2 of each group


class GraphedRunner(StepRunner):
    """The step runner with graphs on, on the CPU (where the engine refuses cuda_graphs)."""

    def __init__(self, compile=False, cuda_graphs=False) -> None:
        super().__init__(compile, cuda_graphs)
        self.graphs = RecordedGraphs()


class Timeline:
    """(what, thread, start, end) of every recorded span."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, what: str, hold: float = 0.0):
        start = time.perf_counter()
        try:
            yield
            time.sleep(hold)  # widens the span: an overlap the code allows shows on every run
        finally:
            with self._lock:
                self.spans.append((what, threading.current_thread().name, start, time.perf_counter()))

    def timed(self, what: str, function, hold: float = 0.0):
        def run(*args, **kwargs):
            with self.span(what, hold):
                return function(*args, **kwargs)

        return run

    def of(self, what: str, thread: str | None = None) -> list[tuple[str, str, float, float]]:
        return [s for s in self.spans if s[0] == what and (thread is None or s[1] == thread)]

    def overlaps(self, these: list, those: list) -> list:
        """Pairs of spans, one from each list, on different threads and running at the same time."""
        return [(a, b) for a in these for b in those if a[1] != b[1] and a[2] < b[3] and b[2] < a[3]]


@pytest.fixture
def timeline(monkeypatch):
    """Records captures, updates, weight snapshots, evals and generate calls of the runs in the test."""
    timeline = Timeline()
    graphs = CudaGraphs
    if not ON_CUDA:
        monkeypatch.setattr(fast, "StepRunner", GraphedRunner)
        graphs = RecordedGraphs
    monkeypatch.setattr(graphs, "_capture", timeline.timed("capture", graphs._capture, hold=0.005))
    monkeypatch.setattr(PolicyUpdater, "update", timeline.timed("update", PolicyUpdater.update, hold=0.02))
    monkeypatch.setattr(async_generation, "trainable_snapshot",
                        timeline.timed("publish", async_generation.trainable_snapshot))
    monkeypatch.setattr(trainer_module, "evaluate", timeline.timed("eval", trainer_module.evaluate))
    generate = FastEngine.generate

    def generate_afresh(engine, *args):
        """A slow generator thread (an eval that does not wait for it overlaps it), and every call captures anew,
        as after an engine reallocates the state its graphs read."""
        slow = threading.current_thread().name == GENERATOR
        with timeline.span("generate", hold=0.1 if slow else 0.0):
            out = generate(engine, *args)
        engine.runner.reset()
        return out

    monkeypatch.setattr(FastEngine, "generate", generate_afresh)
    return timeline


def test_captures_never_run_beside_learner_device_work_nor_evals_beside_generation(tmp_path, warm_cache,
                                                                                  timeline):
    """A lag of 1 (batch k+1 generated while step k updates), ended by its rollout budget at step 3, between evals
    (its final eval is the only one after step 0): every capture alone on the device, no eval beside generation."""
    trainer = Trainer(config(tmp_path / "run", warm_cache, staleness=1, **{
        "train.max_rollouts": 3 * ROLLOUTS_PER_STEP, "train.eval_every": 100, "train.save_every": 100}))
    summary = trainer.train()
    assert summary["step"] == 3 and "eval/accuracy" in summary
    learner_work = timeline.of("update") + timeline.of("publish") + timeline.of("eval")
    generator_captures = timeline.of("capture", GENERATOR)
    assert len(generator_captures) >= 3 and len(timeline.of("update")) == 3  # graphs were used on the generator
    assert timeline.overlaps(timeline.of("capture"), learner_work + timeline.of("generate")) == []
    assert timeline.overlaps(timeline.of("eval"), timeline.of("generate", GENERATOR)) == []


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a CUDA device (pytest --device cuda)")
def test_async_run_with_cuda_graphs_on(tmp_path, warm_cache, monkeypatch):
    """Nothing instrumented but a count: the generator captures and replays real graphs while the learner updates,
    and the eval engine captures its own. (The engines release their graphs with their state before each update and
    after each eval, so what they hold at the end says nothing of what ran: the captures are counted by thread.)"""
    captures: list[str] = []
    capture = CudaGraphs._capture

    def counted(graphs, step):
        captures.append(threading.current_thread().name)
        return capture(graphs, step)

    monkeypatch.setattr(CudaGraphs, "_capture", counted)
    trainer = Trainer(config(tmp_path / "run", warm_cache, staleness=1, **{"train.eval_every": 2}))
    summary = trainer.train()
    assert summary["step"] == trainer.cfg.train.max_steps and summary["engine"] == "fast"
    assert trainer.parts.engine.runner.graphs is not None and trainer.parts.eval_engine.runner.graphs is not None
    assert GENERATOR in captures and any(name != GENERATOR for name in captures)  # the eval's, on the learner
