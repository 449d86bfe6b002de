"""Generation ahead of the learner (`train.async`): a background thread produces the next steps' batches while the
learner updates on the current one.

Fixed lag. The batch trained at step k is produced under the weights of step v(k) = max(k - s, base), s =
`max_staleness`, base = the step the generator started at (0, or the resumed step). The generator may run ahead
only as far as the weights it needs exist, so staleness never exceeds s by construction, and everything a batch
depends on (weights, data position, RNG draws, per-prompt history, method state) is fixed by k alone: timing changes
throughput, never the run. s = 0 is the synchronous loop (no overlap).

The learner publishes w_k at the start of step k (after the step-k checkpoint, so the generator is quiet while one is
written); the generator loads the version it needs into its own copy of the policy before producing a batch and
hands it to the engine's weight sync (a no-op in process, one `ray.put` for the Ray pool).

The producer (podsrl/run/producer.py: its data position, RNG, per-prompt history, method, engine) belongs to the generator
thread while it runs; the learner reads it only after `quiesce` (checkpoints, evals). On a GPU the
generator's engine may capture CUDA graphs: the learner's device work beside it holds capture_lock.CAPTURE_LOCK.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from podsrl import waits
from podsrl.batch import RolloutBatch
from podsrl.build import rollout_engine, sampling_dtype
from podsrl.config import Config
from podsrl.engines import build_engine
from podsrl.engines.base import RolloutEngine
from podsrl.engines.capture_lock import CAPTURE_LOCK
from podsrl.engines.weights_copy import compute_copy
from podsrl.episodes.calls import Interrupted
from podsrl.errors import UserError
from podsrl.models.decode import share_fused_weights
from podsrl.run.producer import ProducedBatch

GENERATOR = "podsrl-generator"  # the generator thread's name
GENERATOR_THREAD = f"the async generator thread, {GENERATOR}"


def async_engines(cfg: Config, generation_model: torch.nn.Module, tokenizer, distributed: bool,
                  compute_dtype: torch.dtype):
    """(generator's model, its engine, eval engine, eval tokenizer): the generator samples from its own copy of the
    policy; eval (in process) and checkpoints use the learner's."""
    if distributed:
        raise UserError("train.async.enabled: one process only for now (under torchrun the generation shards "
                        "all-gather on the process group the update uses, from another thread)")
    traits = cfg.rollout.engine_type
    if traits.compute_dtype_option:  # one copy, in the dtype its engine samples in (not a float32 one and the engine's)
        dtype = sampling_dtype(cfg, generation_model, compute_dtype)
        generator_model = compute_copy(generation_model, dtype) or copy.deepcopy(generation_model)
        generator_model.requires_grad_(False)
        share_fused_weights(generator_model)  # only sampled from and loaded into, never trained or saved
    else:  # requires_grad as the learner's: the trainable parameters are the ones synced to the workers (Ray actors)
        generator_model = copy.deepcopy(generation_model)
    generator_model.eval()
    engine = rollout_engine(cfg, generator_model, tokenizer, compute_dtype)
    worker = traits.worker_engine(cfg.rollout.engine_options)
    if worker is None:
        eval_engine = rollout_engine(cfg, generation_model, tokenizer, compute_dtype)
    else:  # eval in process, with the engine the workers run
        name, options, _ = worker
        eval_engine = build_engine(name, generation_model, tokenizer, **options)
    return generator_model, engine, eval_engine, copy.deepcopy(tokenizer)  # a fast tokenizer is not thread-safe


def split_threads(generator_threads: int) -> int:
    """The in-process generator's torch threads: `generator_threads`, or half of the process's, in which case the
    learner keeps the other half (the caller restores the process's count at the end)."""
    if generator_threads:
        return generator_threads
    total = torch.get_num_threads()
    torch.set_num_threads(max(1, total - max(1, total // 2)))
    return max(1, total // 2)


def staleness_metrics(trained_at: int, kept: RolloutBatch, dropped_batches: int) -> dict[str, float]:
    """async/*: how many steps old the weights that sampled the trained rows were, and batches dropped as too old."""
    staleness = (trained_at - kept.policy_version).float()
    return {"async/staleness_mean": float(staleness.mean()) if staleness.numel() else 0.0,
            "async/staleness_max": float(staleness.max()) if staleness.numel() else 0.0,
            "async/dropped_batches": float(dropped_batches)}


def trainable_snapshot(model: torch.nn.Module, like: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters an update changes (frozen ones, e.g. a LoRA base, are in the generator's copy), each
    in the dtype of `like`'s parameter of that name (the generator's copy: rounded now, as loading would)."""
    dtypes = {n: p.dtype for n, p in like.named_parameters()}
    return {n: p.detach().to(dtypes[n], copy=True) for n, p in model.named_parameters() if p.requires_grad}


class BackgroundGenerator:
    """The generator thread and its hand-over queue; see the module docstring."""

    def __init__(self, produce: Callable[[int], ProducedBatch], model: torch.nn.Module, engine: RolloutEngine,
                 max_staleness: int, step: int, max_steps: int, in_flight: list[ProducedBatch] = (),
                 threads: int = 0, start: dict | None = None) -> None:
        self._produce = produce  # step index -> that step's batch, under the weights loaded in `model`
        self.model, self.engine, self.max_staleness = model, engine, max_staleness
        self.base = self._published = self._loaded = step  # `model` holds w_step now
        self.max_steps, self.threads = max_steps, threads
        self._weights: dict[int, dict[str, torch.Tensor]] = {}  # published, not yet loaded
        if start is not None:  # a resume after a stop abandoned a batch: its weights, older than w_step, first
            self.base = start["version"]
            params = dict(model.named_parameters())
            self._weights[step] = {n: params[n].detach().clone() for n in start["weights"]}  # w_step, kept for later
            self._weights[start["version"]] = start["weights"]
        # A resume with a smaller max_staleness: saved batches that would now train too late are dropped.
        self._queue: deque[ProducedBatch] = deque()
        self.dropped = 0
        for batch in in_flight:
            if step + len(self._queue) - batch.version > max_staleness:
                self.dropped += 1
            else:
                self._queue.append(batch)
        self._head = step  # the step of the batch at the front of the queue
        self._next = step + len(self._queue)  # the step of the next batch to produce
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        # a stop request abandoned the batch in flight (the producer is as before it): quiet for good
        self._waiting = self._stop = self._interrupted = False
        self._stalled = False  # a wait for it expired
        self._thread: threading.Thread | None = None

    def version_for(self, step: int) -> int:
        return max(step - self.max_staleness, self.base)

    # ------------------------------------------------------------------------------------------- learner side

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """The learner's weights after `version` steps, for the batches that need them (copied now: the learner
        goes on updating its module in place)."""
        with self._cv:
            if version <= self._published:
                return
        with CAPTURE_LOCK:  # device copies: none beside a capture on the generator thread
            snapshot = trainable_snapshot(model, self.model)
        with self._cv:
            self._weights[version], self._published = snapshot, version
            self._cv.notify_all()

    def take(self, step: int) -> tuple[ProducedBatch, float]:
        """The batch of `step` and the seconds the learner waited for it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=GENERATOR, daemon=True)
            self._thread.start()
        t0 = time.perf_counter()
        with self._cv:
            self._wait(lambda: self._queue or self._error is not None or self._interrupted, f"step {step}'s batch")
            self._raise_error()
            if not self._queue:
                raise Interrupted(f"stop requested while step {step}'s batch was produced")
            if self._head != step:
                raise RuntimeError(f"async generation: the learner asked for step {step}'s batch, the queue holds "
                                   f"step {self._head}'s")
            batch = self._queue.popleft()
            self._head += 1
            self._cv.notify_all()
        return batch, time.perf_counter() - t0

    @property
    def idle(self) -> bool:
        """Not producing: not started, waiting for weights not yet published, or done."""
        return self._thread is None or self._waiting

    def quiesce(self) -> list[ProducedBatch]:
        """Waits until the generator needs weights not yet published (or has nothing left to produce), then returns
        the batches produced and not yet trained, in step order. Until the next `publish` the generator's state
        (and the trainer state it produces from) stays as it is: what a checkpoint saves."""
        with self._cv:
            self._wait(lambda: self.idle or self._error is not None, "the batch in production to finish")
            self._raise_error()
            return list(self._queue)

    def abandoned(self, names: list[str]) -> dict | None:
        """After a stop abandoned the batch being produced: the weights it was being sampled from (the parameters
        `names`), {"version", "weights"}, for the checkpoint; else None."""
        if not self._interrupted:
            return None
        params = dict(self.model.named_parameters())
        return {"version": self._loaded, "weights": {n: params[n].detach().clone() for n in names}}

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None and not self._stalled:  # a stalled thread is left behind (a daemon)
            waits.join(self._thread, "its call in progress to return", GENERATOR_THREAD)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """The learner waits (the condition's lock held) until `ready()`, at most train.wait_timeout_s."""
        try:
            waits.wait_until(self._cv, ready, what, GENERATOR_THREAD)
        except waits.WaitExpired:
            self._stalled = True  # `close` does not wait for it again
            raise

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------------------------------- generator side

    def _run(self) -> None:
        if self.threads:  # per thread: the learner's own setting is untouched
            torch.set_num_threads(self.threads)
        try:
            while True:
                t0 = time.perf_counter()
                with self._cv:
                    while not self._stop and (self._next >= self.max_steps
                                              or self.version_for(self._next) > self._published):
                        self._waiting = True
                        self._cv.notify_all()
                        self._cv.wait()
                    self._waiting = False
                    if self._stop:
                        return
                    step, version = self._next, self.version_for(self._next)
                    weights = self._weights.get(version)
                    for old in [v for v in self._weights if v <= version]:
                        del self._weights[old]
                idle = time.perf_counter() - t0
                if version != self._loaded:
                    self._load(weights)
                    self._loaded = version
                try:
                    produced = self._produce(step)
                except Interrupted:
                    with self._cv:
                        self._interrupted = self._waiting = True
                        self._cv.notify_all()
                    return
                produced.version, produced.generator_idle = version, idle
                produced.kept.policy_version = torch.full((produced.kept.num_rollouts,), version, dtype=torch.long)
                with self._cv:
                    self._queue.append(produced)
                    self._next += 1
                    self._cv.notify_all()
        except BaseException as e:  # handed to the learner, which raises it from take/quiesce
            with self._cv:
                self._error = e
                self._cv.notify_all()

    @torch.no_grad()
    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for name, value in weights.items():
            params[name].copy_(value)
        self.engine.sync_weights(self.model)
