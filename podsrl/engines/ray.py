"""`rollout.engine: ray`: a pool of Ray actors, each holding a copy of the policy and generating a shard of every
request with an in-process engine (fast by default, hf when asked).

- Sharding: whole prompt groups, contiguous, balanced by rows (shards.py); per-row seeds travel with their rows, so
  with the fast engine the pool returns exactly what one in-process engine returns for the same seeds.
- Weights: after each update the trainer's trainable parameters are put into the object store once (one `ray.put`)
  and every actor receives the same reference; actors on one node read the shared copy.
- Faults: a shard whose actor died or raised is retried on a fresh actor (built from the model put at start-up plus
  the latest weights), at most `max_retries` times per shard and call, then `WorkerFailure` says what happened. An
  actor that dies while loading synced weights is replaced, except under max_retries 0, which allows no replacement.
- Episodes (`session`): each episode's turns run on the actor it was first given to (shards.EpisodeShards), in that
  actor's fast-engine session (continuation.py), so a turn prefills only what the actor's cache of the episode
  lacks. A replaced actor starts with no caches: its episodes' next turn prefills them whole. Memory: each actor
  holds its live episodes' caches between turns; an actor with no live episode drops its session, and the
  session's `close` (the runner's) and the engine's `release` (the trainer's, before each update) drop every
  actor's.

Options (`rollout.engine_options`): num_workers (2), address (None: start a local Ray; "auto" or "host:port" joins a
cluster), num_cpus (local Ray only), cpus_per_worker (1, also the actor's torch threads), gpus_per_worker (0),
engine ("fast" | "hf"), engine_options (dict for the inner engine), max_retries (2), timeout_s (None: the run's
train.wait_timeout_s; a request with no shard finishing for that long counts as failed on every pending shard, and a
shard that still times out after max_retries fresh actors stops the run: podsrl/waits.py WaitExpired naming the
worker), init_options (extra `ray.init` keywords), startup_timeout_s (600: actors not up by then fail with a
message). Every other wait on the actors (weight loads, sessions' closing, digests) lasts at most
train.wait_timeout_s.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import itertools
import logging
import os
import time
import weakref
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from podsrl import waits
from podsrl.engines.base import EpisodeSession, GenerationOutput, RolloutEngine, SamplingParams
from podsrl.engines.hf import model_device
from podsrl.engines.rows import check_request, no_token_output, special_ids
from podsrl.engines.shards import EpisodeShards, merge_outputs, merge_rows, shard_groups
from podsrl.errors import WorkerLost

logger = logging.getLogger("podsrl")


class WorkerFailure(WorkerLost, RuntimeError):
    """A shard failed more often than the retry bound allows."""


def state_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter and buffer (name, dtype, bytes): equal digests mean equal weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the parameters an update can change (frozen ones, e.g. a LoRA base, never need resending)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def _with_package_path(runtime_env: dict | None) -> dict:
    """Actors must import this very podsrl (a checkout may shadow an installed copy): put its parent directory
    first on the workers' PYTHONPATH (a path missing on another node is ignored there)."""
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars", {}))
    root = str(Path(__file__).resolve().parents[2])
    current = env_vars.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    env_vars["PYTHONPATH"] = os.pathsep.join([root, current]) if current else root
    env["env_vars"] = env_vars
    return env


class RolloutWorker:
    """Body of one actor: a policy copy and an in-process engine over it."""

    def __init__(self, model: torch.nn.Module, weights: dict[str, torch.Tensor] | None, engine: str,
                 options: dict[str, Any], threads: int, device: str) -> None:
        torch.set_num_threads(max(1, threads))
        self.model = model.to(device).eval().requires_grad_(False)
        self.engine: RolloutEngine | None = None
        if weights is not None:
            self.load_weights(weights)
        from podsrl.engines import build_engine

        self.engine = build_engine(engine, self.model, None, **options)
        self.sessions: dict[int, EpisodeSession] = {}  # the pool's open episode sessions (RaySession.id) here

    def generate(self, prompts, counts, params, seeds) -> GenerationOutput:
        return self.engine.generate(prompts, counts, params, seeds)

    def continues(self) -> bool:
        """Whether this actor's engine continues episodes' KV caches (the fast engine on its static-shape step)."""
        with self.engine.session() as session:
            return session.continues

    def session_generate(self, session_id: int, keys: list, contexts: list[list[int]], params: SamplingParams,
                         seeds: torch.Tensor) -> GenerationOutput | None:
        """A turn of this actor's episodes of session `session_id`, in this actor's session of it (opened on its
        first turn here). No episodes: the actor's have all ended, so its session is closed."""
        if not keys:
            self.close_session(session_id)
            return None
        if session_id not in self.sessions:
            self.sessions[session_id] = self.engine.session()
        return self.sessions[session_id].generate(keys, contexts, params, seeds)

    def close_session(self, session_id: int) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            session.close()

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        missing = sorted(set(weights) - set(params))
        if missing:
            raise KeyError(f"weights for parameters this worker's model lacks: {missing[:5]}")
        for name, value in weights.items():
            params[name].copy_(value)
        if self.engine is not None:  # an engine sampling from its own copy (weights_dtype) follows
            self.engine.sync_weights(self.model)

    def digest(self) -> str:
        return state_digest(self.model)


class RayEngine(RolloutEngine):
    """Actor pool; see the module docstring."""

    name = "ray"
    may_run_async = True
    generation_device = "cpu"  # the copy the workers are sent the weights from
    in_process = False

    @classmethod
    def local_worker_cores(cls, options: dict) -> int:
        """A local Ray's actors, each on max(1, cpus_per_worker) threads; none when it joins a cluster."""
        given = {**{name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()}, **options}
        if given["address"] is not None:
            return 0
        return int(given["num_workers"]) * max(1, int(given["cpus_per_worker"]))

    @classmethod
    def worker_engine(cls, options: dict) -> tuple[str, dict, str]:
        return options.get("engine", "fast"), options.get("engine_options") or {}, "engine_options"

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, num_workers: int = 2,
                 address: str | None = None, num_cpus: int | None = None, cpus_per_worker: float = 1,
                 gpus_per_worker: float = 0, engine: str = "fast", engine_options: dict | None = None,
                 max_retries: int = 2, timeout_s: float | None = None, init_options: dict | None = None,
                 startup_timeout_s: float = 600.0, **options: Any) -> None:
        try:
            import ray
        except ImportError as e:  # pragma: no cover - depends on the environment
            from podsrl.errors import ConfigError

            raise ConfigError("rollout.engine: 'ray' needs Ray: pip install 'podsrl[ray]'") from e
        if engine not in ("fast", "hf"):
            from podsrl.errors import ConfigError

            raise ConfigError(f"rollout.engine_options.engine: {engine!r} (the ray pool runs 'fast' or 'hf')")
        if num_workers < 1:
            from podsrl.errors import ConfigError

            raise ConfigError(f"rollout.engine_options.num_workers: must be >= 1, got {num_workers}")
        self._ray = ray
        t0 = time.perf_counter()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kwargs = {"include_dashboard": False, "logging_level": logging.WARNING, **(init_options or {})}
            if address is None:
                kwargs["num_cpus"] = num_cpus
            kwargs["runtime_env"] = _with_package_path(kwargs.get("runtime_env"))
            ray.init(address=address, **kwargs)
        # Special ids resolved here so actors need no tokenizer; options win, as in the in-process engines.
        eos, pad = special_ids(model, tokenizer, options)
        self.pad_token_id = pad
        self.inner, self.inner_options = engine, {**(engine_options or {}), "eos_token_id": eos, "pad_token_id": pad}
        self.max_retries, self.timeout_s = max_retries, timeout_s
        self.threads = max(1, int(cpus_per_worker))
        self.device = "cuda" if gpus_per_worker > 0 else "cpu"
        self._actor_cls = ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=0)(
            RolloutWorker)
        skeleton = model if model_device(model).type == "cpu" else copy.deepcopy(model).cpu()
        self._model_ref = ray.put(skeleton)  # pickled once: every (re)started actor is built from it
        self._weights_ref = None  # latest synced weights; None = those in the skeleton
        self._check_resources(num_workers, cpus_per_worker, gpus_per_worker, local=address is None)
        self.workers = [self._spawn() for _ in range(num_workers)]
        try:  # wait until every actor is up (and fail here, not in the first step, if they cannot start)
            ray.get([w.digest.remote() for w in self.workers], timeout=startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise WorkerFailure(
                f"ray engine: {num_workers} actors ({cpus_per_worker} CPU, {gpus_per_worker} GPU each) did not "
                f"start within startup_timeout_s={startup_timeout_s}; free resources: "
                f"{ray.available_resources()}") from None
        self.continues = self._get(self.workers[0].continues.remote(), "whether its engine continues episodes", 0)
        self.sessions: weakref.WeakSet[RaySession] = weakref.WeakSet()  # open ones: `release` closes them
        self._session_ids = itertools.count()
        self.restarts = 0
        self.startup_seconds = time.perf_counter() - t0
        self.last_sync_seconds = 0.0

    def _check_resources(self, workers: int, cpus: float, gpus: float, local: bool) -> None:
        """A local Ray never grows: a pool larger than it would wait forever, so say so now."""
        if not local:
            return  # a cluster may autoscale; the start-up timeout bounds the wait instead
        total = self._ray.cluster_resources()
        for name, each, key in (("CPU", cpus, "CPU"), ("GPU", gpus, "GPU")):
            if workers * each > total.get(key, 0) + 1e-9:
                from podsrl.errors import ConfigError

                self.close()
                raise ConfigError(
                    f"rollout.engine_options: {workers} workers x {each} {name} exceed the local Ray's "
                    f"{total.get(key, 0):g} {name}s; lower num_workers or the per-worker share, or raise num_cpus")

    def _spawn(self):
        return self._actor_cls.remote(self._model_ref, self._weights_ref, self.inner, self.inner_options,
                                      self.threads, self.device)

    def _kill(self, actor) -> None:
        with contextlib.suppress(ValueError, self._ray.exceptions.RayError):  # already gone
            self._ray.kill(actor, no_restart=True)

    def _restart(self, index: int, reason: BaseException) -> None:
        logger.warning("ray engine: worker %d failed (%s); starting a replacement", index,
                       str(reason).splitlines()[0] if str(reason) else type(reason).__name__)
        self._kill(self.workers[index])
        self.workers[index] = self._spawn()
        self.restarts += 1

    def _failure(self, index: int, what: str, attempts: int, error: BaseException) -> WorkerFailure:
        last = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return WorkerFailure(f"ray engine: worker {index}, {what}, failed {attempts} times, the bound set by "
                             f"rollout.engine_options.max_retries={self.max_retries}; last error: {last[:300]}")

    def generate(self, prompts: list[list[int]], counts: list[int], params: SamplingParams,
                 seeds: torch.Tensor) -> GenerationOutput:
        rows = check_request(prompts, counts, seeds)  # bad requests fail here, not as retried worker errors
        if rows == 0 or params.max_new_tokens <= 0:
            return no_token_output(prompts, counts, rows, self.pad_token_id, params.return_logprobs)
        seeds = seeds.long().cpu()
        shards = shard_groups(counts, len(self.workers))

        def shard_call(s) -> Callable:
            return lambda worker: worker.generate.remote(prompts[s.start:s.end], counts[s.start:s.end], params,
                                                         seeds[s.row_start:s.row_end])

        results = self.on_workers({k: shard_call(s) for k, s in enumerate(shards) if s.rows > 0},
                                  lambda k: f"shard {k} (prompts {shards[k].start}-{shards[k].end - 1})")
        parts = [(shards[k], results[k]) for k in sorted(results)]
        return merge_outputs(parts, self.pad_token_id, params.return_logprobs)

    def on_workers(self, calls: dict[int, Callable], what: Callable[[int], str]) -> dict[int, Any]:
        """Each call's result, `calls[k](actor k)` being a remote call to actor k (all submitted at once). A call
        whose actor died or raised, or every pending one when none finished within timeout_s, is retried on a fresh
        actor, at most max_retries times per call; `what(k)` names call k's work in the failure."""
        results: dict[int, Any] = {}
        attempts = dict.fromkeys(calls, 0)
        pending: dict[Any, int] = {}  # object ref -> worker index

        def submit(k: int) -> None:
            pending[calls[k](self.workers[k])] = k

        def failed(k: int, error: BaseException) -> None:
            attempts[k] += 1
            if attempts[k] > self.max_retries and isinstance(error, TimeoutError):  # a hang: stop, saying where
                setting = "rollout.engine_options.timeout_s" if self.timeout_s else "train.wait_timeout_s"
                raise waits.WaitExpired(f"a result of {what(k)}", f"ray worker {k}, try {attempts[k]} of "
                                        f"{self.max_retries + 1}", self.timeout_s, setting) from None
            if attempts[k] > self.max_retries:
                raise self._failure(k, what(k), attempts[k], error) from error
            self._restart(k, error)
            submit(k)

        for k in calls:
            submit(k)
        timeout = self.timeout_s or waits.bound()
        while pending:
            ready, _ = self._ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:  # nothing finished in timeout: every pending call counts as failed
                stuck = list(pending.items())
                pending.clear()
                for _, k in stuck:
                    failed(k, TimeoutError(f"no result within {timeout:g} s"))
                continue
            k = pending.pop(ready[0])
            try:
                results[k] = self._ray.get(ready[0])
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.RayTaskError) as e:
                failed(k, e)
        return results

    def session(self) -> EpisodeSession:
        """Episodes continue their KV caches on the actors that hold them (RaySession) where the actors' engine
        continues them; otherwise each turn is a `generate` over the whole contexts."""
        if not self.continues:
            return super().session()
        session = RaySession(self, next(self._session_ids))
        self.sessions.add(session)
        return session

    def close_session(self, session_id: int) -> None:
        """Every actor drops its session `session_id` (an actor that died holds none)."""
        for k, ref in enumerate([w.close_session.remote(session_id) for w in self.workers]):
            with contextlib.suppress(self._ray.exceptions.RayActorError):
                self._get(ref, f"episode session {session_id} to close", k)

    def release(self) -> None:
        """Closes the open episode sessions: the actors free their caches (a session's next turn then prefills its
        episodes whole)."""
        for session in list(self.sessions):
            session.close()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """One `ray.put` of the trainable weights; every actor loads from that one object."""
        t0 = time.perf_counter()
        self._weights_ref = self._ray.put(trainable_weights(model))
        calls = {self.workers[i].load_weights.remote(self._weights_ref): i for i in range(len(self.workers))}
        for ref, i in calls.items():
            try:
                self._get(ref, "the synced weights to load", i)
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.RayTaskError) as e:
                if self.max_retries < 1:  # no replacements at all: a worker lost between calls ends the run too
                    raise self._failure(i, "the synced weights to load", 1, e) from e
                self._restart(i, e)  # the replacement is built with the new weights
        self.last_sync_seconds = time.perf_counter() - t0

    def worker_digests(self) -> list[str]:
        """`state_digest` of every actor's model (compare with the trainer's)."""
        return [self._get(w.digest.remote(), "its weights' digest", k) for k, w in enumerate(self.workers)]

    def _get(self, ref, what: str, worker: int):
        """ray.get of one actor's call, at most train.wait_timeout_s."""
        try:
            return self._ray.get(ref, timeout=waits.bound())
        except self._ray.exceptions.GetTimeoutError:
            raise waits.WaitExpired(what, f"ray worker {worker}") from None

    def close(self) -> None:
        for w in getattr(self, "workers", []):
            self._kill(w)
        self.workers = []
        if getattr(self, "_owns_ray", False) and self._ray.is_initialized():
            self._ray.shutdown()


class RaySession(EpisodeSession):
    """The pool's episode session (see the module docstring)."""

    continues = True

    def __init__(self, engine: RayEngine, session_id: int) -> None:
        super().__init__(engine)
        self.id = session_id
        self.shards = EpisodeShards(len(engine.workers))
        self.busy: set[int] = set()  # the actors holding a session of it

    def generate(self, keys: list[Hashable], contexts: list[list[int]], params: SamplingParams,
                 seeds: torch.Tensor) -> GenerationOutput:
        rows = check_request(contexts, [1] * len(contexts), seeds)
        if rows == 0 or params.max_new_tokens <= 0:
            return no_token_output(contexts, [1] * rows, rows, self.engine.pad_token_id, params.return_logprobs)
        seeds = seeds.long().cpu()
        split = self.shards.split(keys)

        def turn(mine: list[int]) -> Callable:  # an empty turn closes the actor's session (its episodes ended)
            return lambda worker: worker.session_generate.remote(self.id, [keys[r] for r in mine],
                                                                 [contexts[r] for r in mine], params, seeds[mine])

        calls = {k: turn(mine) for k, mine in enumerate(split) if mine or k in self.busy}
        results = self.engine.on_workers(calls, lambda k: f"the episode turns of worker {k}")
        self.busy = {k for k, mine in enumerate(split) if mine}
        return merge_rows([(split[k], results[k]) for k in sorted(self.busy)], self.engine.pad_token_id,
                          params.return_logprobs)

    def close(self) -> None:
        self.engine.close_session(self.id)
        self.busy = set()
