"""The training loop, top to bottom: the learner. One step takes its batch from the producer (podsrl/run/producer.py:
problems -> collect -> select -> refill -> advantage clip, the method's stages), then updates on it, then evals,
logs and checkpoints when due. This file names no method.

Synchronously the producer runs in process before each update; with `train.async` it runs ahead on the background
generator's thread (podsrl/run/async_generation.py) while the learner updates, and the learner reads it only once that
thread is quiet.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import time
from pathlib import Path

import torch

from podsrl import threads, waits
from podsrl.batch import RolloutBatch
from podsrl.build import load_model, load_task, reward_manager, rollout_engine, verifier
from podsrl.config import Config, dump_config
from podsrl.config.facts import run_facts, unread_settings
from podsrl.distributed import NullLogger, init_distributed
from podsrl.engines.capture_lock import CAPTURE_LOCK
from podsrl.episodes.calls import CALLS, STOP, Interrupted
from podsrl.episodes.runner import task_episodes
from podsrl.errors import UnhealthyRun, UserError, WorkerLost
from podsrl.fileio import write_text_atomic
from podsrl.fsdp import build_data_parallel, fsdp_sharding
from podsrl.methods import METHODS
from podsrl.models.loading import count_parameters, resolve_device
from podsrl.models.transformers_api import model_context
from podsrl.reporting.plotting import plot_run
from podsrl.reporting.tracking import build_metrics_logger, build_progress, read_metrics
from podsrl.run import faults
from podsrl.run.accounting import ComputeAccountant
from podsrl.run.async_generation import BackgroundGenerator, async_engines, split_threads, staleness_metrics
from podsrl.run.checkpoint import (
    in_flight_on_resume,
    load_checkpoint_files,
    load_generator,
    load_sharded_tensors,
    prepare_run_dir,
    python_random_state,
    resume_checkpoint,
    save_checkpoint,
    set_python_random_state,
)
from podsrl.run.description import (
    describe_checkpoint_size,
    describe_run,
    tokenizer_identity,
    world_size_change,
)
from podsrl.run.engine_state import keeps_engine_state
from podsrl.run.evaluation import evaluate
from podsrl.run.health import HealthMonitor
from podsrl.run.lock import RunLock
from podsrl.run.log import RankLog
from podsrl.run.micro_batch import resolve_micro_batch
from podsrl.run.producer import BatchProducer, ProducedBatch, StepRecord
from podsrl.run.warmup import base_weights, resume_base_weights
from podsrl.update import PolicyUpdater, UpdateSettings
from podsrl.update.optimizer import build_optimizer

log = logging.getLogger("podsrl")

LEARNER_SEED_OFFSET = 0x1EA2  # train.async: the learner's own RNG stream (mini-batch order), apart from the generator's


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        waits.configure(cfg.train.wait_timeout_s)  # every wait on another process or thread, collectives too
        self.dist = init_distributed(resolve_device(cfg.model.device))  # torchrun: this rank's place and device
        # One writer per run directory (rank 0 for the job), held until train() returns, with its run.log.
        self.lock = RunLock(self.run_dir, keep_log=True) if self.dist.is_main else None
        self.rank_log = RankLog(self.run_dir, self.dist.rank) if cfg.log.rank_logs and not self.dist.is_main else None
        try:
            self._build(resume)
        except BaseException:
            self._release_run_dir()
            raise

    def _build(self, resume: bool) -> None:
        cfg = self.cfg
        prepare_run_dir(self.run_dir, resume)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.device = self.dist.device
        self.facts = run_facts(cfg, self.device)
        unread = unread_settings(cfg)
        if unread and self.dist.is_main:
            log.warning("settings nothing in this run reads (method: %s reads only its own section): %s",
                        cfg.method, ", ".join(unread))
        checkpoint, self.skipped_checkpoints = resume_checkpoint(self.run_dir) if resume else (None, [])
        if resume and checkpoint is None:
            log.warning("no checkpoint in %s (none saved yet): starting from the beginning", self.run_dir)
        with self.dist.main_first():  # a resume reads the warm-up only where the checkpoint does not replace it
            self.base_path = (resume_base_weights(cfg, checkpoint, cfg.log.progress) if checkpoint is not None
                              else base_weights(cfg, progress=cfg.log.progress))
        # FSDP2 under torchrun: policy and reference go straight into their shards as they load (no rank holds
        # either whole), the reference before anything else is built
        sharding = fsdp_sharding(self.dist, cfg, self.facts.compute_dtype)
        self.model, self.tokenizer = load_model(cfg, checkpoint / "model" if checkpoint else None, self.base_path,
                                                trainable=True, ctx=self.dist,
                                                shard=sharding.shard if sharding else None)
        self.ref_model = None
        # frozen copy of the starting policy; not loaded at all when beta = 0, nor with LoRA (the policy with its
        # adapters disabled is the starting policy: podsrl/update/updater.py reference_logprobs)
        if cfg.algo.beta > 0 and cfg.model.lora_rank == 0:
            self.ref_model, _ = load_model(cfg, None, self.base_path, trainable=False, ctx=self.dist,
                                           shard=(lambda m: sharding.shard(m.eval().requires_grad_(False)))
                                           if sharding else None)
            self.ref_model.eval().requires_grad_(False)
        if sharding is None:
            self.model.to(self.device)
            if self.ref_model is not None:
                self.ref_model.to(self.device)
        # torchrun: DDP-style, or FSDP2 over the shards (so before the optimiser), which keeps an unsharded copy for
        # the engines; in one process the engines use the policy itself.
        self.data_parallel = build_data_parallel(
            self.dist, self.model, self.ref_model, cfg, self.facts, sharding)
        self.generation_model = self.data_parallel.generation_model if self.data_parallel else self.model
        self.task, self.eval_problems = load_task(cfg, self.tokenizer, self.model)
        if not self.eval_problems:
            log.warning("no eval set (task %s): training without held-out evaluation", self.task.name)
        run_ahead = cfg.train.asynchronous
        if not run_ahead.enabled:
            self.engine = self.dist.wrap_engine(rollout_engine(cfg, self.generation_model, self.tokenizer,
                                                             self.facts.compute_dtype))
            self.eval_engine, self.eval_tokenizer = self.engine, self.tokenizer
        else:
            self.generator_model, self.engine, self.eval_engine, self.eval_tokenizer = async_engines(
                cfg, self.generation_model, self.tokenizer, self.dist.enabled, self.facts.compute_dtype)
        cfg = self.cfg = resolve_micro_batch(cfg, self.generation_model, self.task, self.tokenizer, self.device,
                                             self.dist.world_size, self.dist.is_main)
        self.keep_engine_state = keeps_engine_state(cfg, self.engine, self.generation_model, self.task,
                                                    self.tokenizer, self.device, self.dist.world_size,
                                                    self.dist.is_main)
        # a task with an environment is evaluated on episodes, as it trains
        context = model_context(self.generation_model)
        self.eval_episodes = task_episodes(self.eval_engine, self.eval_tokenizer, self.task, cfg.episode, context)
        rewards = reward_manager(cfg, self.task)
        self.verify = verifier(rewards, self.task)
        method = METHODS[cfg.method](cfg)
        sharded = self.data_parallel is not None and self.data_parallel.sharded
        self.optimizer, self.scheduler = build_optimizer(cfg, self.model, sharded)
        self.updater = PolicyUpdater(self.model, self.optimizer, self.scheduler, UpdateSettings.of(cfg),
                                     self.facts, self.ref_model,
                                     modulation=method.token_modulation(), data_parallel=self.data_parallel)
        self.producer = BatchProducer(cfg, self.task, self.tokenizer, self.engine, rewards, method,
                                      sampler_logprobs=self.updater.needs_sampler_logprobs, context=context)
        self.accountant = ComputeAccountant(count_parameters(self.generation_model))
        # mini-batch order and the probe: the producer's stream when the two sides take turns (synchronous,
        # staleness 0), else the learner's own
        self.update_rng = (torch.Generator().manual_seed(cfg.seed + LEARNER_SEED_OFFSET) if self.facts.overlap
                           else self.producer.rng)
        self.step, self.elapsed = 0, 0.0
        self.dropped_batches = 0  # train.async: in-flight batches dropped as too stale (a resume with a lower bound)
        self.generator: BackgroundGenerator | None = None
        self.stop_requested = self.stopped_by_signal = False
        self.health = HealthMonitor(cfg.train, speak=self.dist.is_main)
        in_flight: list[ProducedBatch] = []
        self.generator_start = None  # train.async: the weights of a batch a stop abandoned (from the checkpoint)
        if checkpoint is not None:
            in_flight = self._restore(checkpoint)
            log.info("resumed %s at step %d", self.run_dir, self.step)
        self.saved_step = self.step  # the step of the newest checkpoint (0: none, or the start)
        if run_ahead.enabled:
            self._build_generator(in_flight)
        log.info(describe_run(cfg, self.facts, self.dist, self.generation_model, self.engine.name))
        log.info(describe_checkpoint_size(cfg, self.model, self.generation_model, sharded))
        if self.dist.is_main:
            dump_config(cfg, self.run_dir / "config.yaml")
        self.logger = (build_metrics_logger(cfg, self.run_dir, self.step if checkpoint is not None else None)
                       if self.dist.is_main else NullLogger())

    def _build_generator(self, in_flight: list[ProducedBatch]) -> None:
        """train.async: the generator thread, from the step and in-flight batches of a resume (if any). In process
        it samples on its own torch threads: train.async.generator_threads, or half of the process's (the learner
        keeps the rest); the Ray pool's workers have theirs."""
        cfg, run_ahead = self.cfg, self.cfg.train.asynchronous
        self.threads = torch.get_num_threads()  # restored by close_engines
        generator_threads = split_threads(run_ahead.generator_threads) if cfg.rollout.engine_type.in_process else 0
        self.generator = BackgroundGenerator(self.producer.produce, self.generator_model, self.engine,
                                             run_ahead.max_staleness, self.step, cfg.train.max_steps, in_flight,
                                             threads=generator_threads, start=self.generator_start)
        self.dropped_batches += self.generator.dropped

    # ------------------------------------------------------------------------------------------- one step

    def train_step(self) -> StepRecord:
        cfg = self.cfg
        t0, cpu0 = time.perf_counter(), time.process_time()
        threads.fit_threads_to_load()  # no more torch threads than the cores other work leaves free
        waits.at_step(self.step + 1)  # named by a wait that expires in it
        faults.fire("step", self.step + 1)
        if self.generator is None:
            produced, waited = self.producer.produce(self.step), 0.0
        else:  # w_step for the batches that need it, then this step's batch (produced ahead, or waited for)
            self.generator.publish(self.step, self.generation_model)
            produced, waited = self.generator.take(self.step)
        kept = self.dist.agree_batch(produced.kept, self.update_rng)
        # the update's memory, not the engine's kept cache, unless the plan counts it (train.async: in flight)
        if self.generator is None and not self.keep_engine_state:
            self.engine.release()
        t_upd = time.perf_counter()
        if faults.fire("loss", self.step + 1):  # injected numerical fault: a NaN loss and gradient
            kept.advantages = torch.full_like(kept.advantages, float("nan"))
            if kept.token_advantages is not None:
                kept.token_advantages = torch.full_like(kept.token_advantages, float("nan"))
        with CAPTURE_LOCK:  # train.async: the generator thread captures no decode-step graph while this runs
            update_metrics = self.updater.update(kept.trim_padding(), self.update_rng) if kept.num_rollouts else {}
            self.optimizer.zero_grad(set_to_none=True)  # the gradients' memory is free for the next generation
            if self.data_parallel is not None:  # FSDP2: gathers the updated shards into the generation copy
                self.data_parallel.sync_generation_model()
            if self.generator is None:
                self.engine.sync_weights(self.generation_model)
        timers = {**produced.timers, "time/update": time.perf_counter() - t_upd}
        if self.generator is not None:
            timers.update({"time/learner_wait": waited, "time/generator_idle": produced.generator_idle})
        step_time = time.perf_counter() - t0
        self.elapsed += time.process_time() - cpu0 if cfg.train.clock == "cpu" else step_time
        self.step += 1
        if self.updater.nonfinite_in_a_row >= cfg.train.max_nonfinite_steps:
            raise UnhealthyRun(f"training stopped: {self.updater.nonfinite_in_a_row} consecutive steps with a "
                            f"non-finite loss or gradient (step {self.step}); try a lower optim.lr. The last good "
                            f"checkpoint is in {self.run_dir / 'checkpoints'}")
        return StepRecord(metrics=self._step_metrics(produced, kept, update_metrics, timers, step_time),
                          timers=timers, generated=produced.generated)

    def _step_metrics(self, produced: ProducedBatch, kept: RolloutBatch, update_metrics: dict, timers: dict,
                      step_time: float) -> dict[str, float]:
        metrics = {"step": self.step, **produced.metrics}
        metrics.update(update_metrics)
        metrics.update(self.accountant.step(
            generated_rollouts=produced.generated_rollouts, generated_tokens=produced.generated_tokens,
            trained_rollouts=kept.num_rollouts, trained_tokens=int(kept.completion_mask.sum()),
            passes=self.cfg.optim.epochs, environment_tokens=produced.environment_tokens,
        ))
        if self.generator is not None:
            metrics.update(staleness_metrics(self.step - 1, kept, self.dropped_batches))
        metrics.update(timers)
        metrics["time/step"] = step_time
        metrics["time/elapsed"] = self.elapsed
        return metrics

    # ------------------------------------------------------------------------------------------- loop

    def budget_left(self) -> bool:
        t = self.cfg.train
        if self.step >= t.max_steps or self.stop_requested:
            return False
        if t.max_seconds and self.elapsed >= t.max_seconds:
            return False
        if t.max_rollouts and self.accountant.totals["rollouts_generated"] >= t.max_rollouts:
            return False
        return True

    def run_eval(self) -> dict:
        cfg = self.cfg
        if not self.eval_problems:
            return {}
        self._settle_generator()  # train.async: no generation beside the eval (a run ended by its time budget)
        t0 = time.perf_counter()
        if self.eval_engine is not self.engine:  # train.async: its weights copy (if any) follows the learner's
            self.eval_engine.sync_weights(self.generation_model)
        metrics = evaluate(self.eval_engine, self.eval_tokenizer, self.eval_problems, self.verify,
                           cfg.rollout.max_new_tokens, cfg.eval.samples, cfg.rollout.temperature,
                           cfg.rollout.top_p, cfg.eval.batch_size, self.eval_episodes)
        # under train.async the eval engine idles beside the update until the next eval: freed; the training
        # engine's state the plan keeps through the update (its rows bounded by the plan's) stays, graphs and all
        if self.eval_engine is not self.engine or not self.keep_engine_state:
            self.eval_engine.release()
        # eval is outside the training clock (time/elapsed); its own cost is logged beside it
        record = {"step": self.step, "time/elapsed": self.elapsed, "time/eval": time.perf_counter() - t0, **metrics}
        record.update(self.accountant.total_metrics())
        self.logger.log(record)
        return metrics

    def train(self) -> dict:
        try:
            return self._train()
        except WorkerLost as e:  # the engine names its worker; the learner adds where the run stands
            raise WorkerLost(f"after step {self.step}: {e}; `podsrl train --resume {self.run_dir}` continues "
                             "from its last checkpoint") from None
        finally:
            self._release_run_dir()

    def _release_run_dir(self) -> None:
        if self.lock is not None:
            self.lock.close()
        if self.rank_log is not None:
            self.rank_log.close()

    def _train(self) -> dict:
        cfg = self.cfg
        progress = build_progress(cfg, cfg.train.max_steps, self.dist.is_main, start=self.step)
        previous = {s: signal.signal(s, self._request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        STOP.clear()
        last_eval: dict = {}
        try:
            try:
                last_eval = self._train_loop(progress)
            except Interrupted:
                # A signal abandoned the episodes in flight (an environment or tool may never return): the last
                # completed step is what a resume continues from, its checkpoint written now if it is not yet.
                if self.step > self.saved_step:
                    self.save()
        finally:
            STOP.clear()
            progress.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.close()
        if self.stop_requested and not self._budget_spent():
            log.warning("stopped by signal at step %d; resume with --resume %s", self.step, self.run_dir)
            self.stopped_by_signal = True
            return last_eval
        summary = {"step": self.step, "time/elapsed": self.elapsed, **last_eval,
                   **self.accountant.total_metrics(), "health_warnings": self.health.warnings,
                   "skipped_checkpoints": self.skipped_checkpoints,
                   "tokenizer": tokenizer_identity(self.tokenizer, cfg.model.name_or_path),
                   # the engine that really sampled, and why it is not the one configured (null: it is)
                   "engine": self.engine.sampler, "engine/fallback": self.engine.fallback_reason}
        if self.dist.is_main:
            if cfg.model.lora_rank > 0:
                from podsrl.lora import export_merged

                export_merged(self.generation_model, self.run_dir / "merged", self.tokenizer)
            write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        if cfg.log.plot and self.dist.is_main:
            plot_run(self.run_dir)
        return summary

    def _train_loop(self, progress) -> dict:
        """Steps until the budget is spent or a signal stops the run; the last eval's metrics."""
        cfg = self.cfg
        last_eval: dict = {}
        if self.step == 0:
            last_eval = self.run_eval()
            progress.update(0, eval_acc=last_eval.get("eval/accuracy"))
        elif not self.dist.agree(self.budget_left()):  # resumed after the last step: needs its final eval
            last_eval = self._logged_eval() or self.run_eval()
        elif not self.dist.enabled and self.step % cfg.train.eval_every == 0 and not self._logged_eval():
            last_eval = self.run_eval()  # a signal abandoned this step's eval, then its checkpoint was written
        while self.dist.agree(self.budget_left()):
            metrics = self.train_step().metrics
            metrics.update(self.health.observe(metrics, self.step))
            self.logger.log(metrics)
            self.health.stop_if_asked(str(self.run_dir / "checkpoints"))
            self._warn_if_slow()
            if self.step % cfg.train.eval_every == 0 or self.step % cfg.train.save_every == 0:
                self._settle_generator()
            finished = not self.dist.agree(self.budget_left())
            # Stopped by a signal: checkpoint at once (a grace period may be short), no extra eval record.
            if self.step % cfg.train.eval_every == 0 or self.dist.agree(self._budget_spent()):
                last_eval = self.run_eval()
            progress.update(self.step, reward=metrics["reward"], train_acc=metrics["correct"],
                            eval_acc=last_eval.get("eval/accuracy"), step_time=metrics["time/step"])
            if self.step % cfg.train.save_every == 0 or finished:
                self.save()
        return last_eval

    def _settle_generator(self) -> None:
        """train.async, before an eval or checkpoint: wait for the batch the generator is producing. The wait
        counts on the training clock: generating while the learner evaluates would be work the clock never sees
        (a free batch per eval in an equal-time comparison)."""
        if self.generator is None:
            return
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.generator.quiesce()
        self.elapsed += time.process_time() - cpu0 if self.cfg.train.clock == "cpu" else time.perf_counter() - t0

    def close(self) -> None:
        """Everything the trainer holds open: the metrics sinks, the generator thread and engines, the process
        group."""
        self.logger.close()
        self.close_engines()
        CALLS.end_children(everything=True)  # processes environments and tools left, hung calls' included
        self.dist.close()

    def close_engines(self) -> None:
        """The generator thread (train.async) first, then the engines it samples with."""
        if self.generator is not None:
            self.generator.close()
            torch.set_num_threads(self.threads)
        self.engine.close()
        if self.eval_engine is not self.engine:
            self.eval_engine.close()

    def _warn_if_slow(self) -> None:
        """train.warn_seconds: say once that this machine is slower than expected; the run goes on to max_steps."""
        limit = self.cfg.train.warn_seconds
        if limit and self.elapsed > limit and not getattr(self, "_warned_slow", False) and self.dist.is_main:
            self._warned_slow = True
            eta = self.elapsed / self.step * (self.cfg.train.max_steps - self.step)
            log.warning("training has taken %.0f s at step %d of %d, past train.warn_seconds=%g: this machine is "
                        "slower or busier than expected. The run continues to max_steps (~%.0f s more), so its "
                        "result does not depend on the machine's speed.", self.elapsed, self.step,
                        self.cfg.train.max_steps, limit, eta)

    def _request_stop(self, signum, frame) -> None:
        # Finish the step in flight, checkpoint, exit cleanly: nothing lost. Episodes waiting on their environments
        # are abandoned at once (STOP), the last completed step checkpointed: a hung tool cannot hold the exit.
        # Under torchrun the ranks must stop at the same point, so their step finishes (environment calls are
        # bounded by their time limits). A second Ctrl-C aborts at once.
        if self.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_requested = True
        if not self.dist.enabled:
            STOP.set()

    def _budget_spent(self) -> bool:
        """The run's own end (steps, seconds or rollouts), as opposed to a stop requested by a signal."""
        requested, self.stop_requested = self.stop_requested, False
        spent = not self.budget_left()
        self.stop_requested = requested
        return spent

    def _logged_eval(self) -> dict:
        """The eval metrics already logged at the current step (kept on resume), or {}."""
        records = [r for r in read_metrics(self.logger.path) if r.get("step") == self.step and "eval/accuracy" in r]
        return {k: v for k, v in records[-1].items() if k.startswith("eval/")} if records else {}

    # ------------------------------------------------------------------------------------------- checkpoints

    def save(self) -> None:
        """Writes the step's checkpoint (every rank under FSDP2, the main rank otherwise): the weights and
        optimiser, the learner's position, clocks, accounting and health, the producer's own state
        (BatchProducer.state_dict) and train.async's in-flight batches."""
        sharded = self.data_parallel is not None and self.data_parallel.sharded
        if not self.dist.is_main and not sharded:  # every rank holds the same state (FSDP2: its own shards)
            return
        # train.async: the producer as of the batches the generator has produced (quiet until the next publish)
        in_flight = [b.state_dict() for b in self.generator.quiesce()] if self.generator is not None else None
        abandoned = None if self.generator is None else self.generator.abandoned(
            [n for n, p in self.generation_model.named_parameters() if p.requires_grad])
        producer = self.producer.state_dict()
        rng_state = {"trainer": producer.pop("rng"), "torch": torch.get_rng_state()}
        if self.update_rng is not self.producer.rng:
            rng_state["learner"] = self.update_rng.get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # a CPU run never starts CUDA
            rng_state["cuda"] = torch.cuda.get_rng_state_all()
        state = {
            "step": self.step, "elapsed": self.elapsed, **producer, "accounting": self.accountant.state_dict(),
            "nonfinite_in_a_row": self.updater.nonfinite_in_a_row, "python_random": python_random_state(),
            "health": self.health.state_dict(), "dropped_batches": self.dropped_batches,
            "world_size": self.dist.world_size,
        }
        optimizer_state = {"scheduler": self.scheduler.state_dict()}
        tensors = None
        if sharded:
            tensors, optimizer_state["param_groups"] = self.data_parallel.checkpoint_state(self.optimizer)
        else:
            optimizer_state["optimizer"] = self.optimizer.state_dict()
        save_checkpoint(self.run_dir, self.step, self.generation_model, self.tokenizer, optimizer_state, rng_state,
                        state, keep=self.cfg.train.keep_checkpoints, sharded_tensors=tensors,
                        dist_ctx=self.dist if sharded else None, in_flight=in_flight, generator=abandoned)
        self.saved_step = self.step

    def _restore(self, path: Path) -> list[ProducedBatch]:
        """Loads a checkpoint's state into the learner and the producer; returns its in-flight batches (train.async),
        oldest first."""
        optimizer_state, rng_state, state = load_checkpoint_files(path)
        sharded = self.data_parallel is not None and self.data_parallel.sharded
        if sharded != ("param_groups" in optimizer_state):
            written = "train.strategy=fsdp under torchrun" if "param_groups" in optimizer_state else \
                "train.strategy=ddp or one process"
            raise UserError(f"checkpoint {path} was written with {written}; resume it the same way")
        if sharded:  # model/ holds the generation copy (compute dtype); the exact shards are in sharded/
            tensors, _ = self.data_parallel.checkpoint_state(self.optimizer)
            load_sharded_tensors(tensors, path / "sharded")
            self.data_parallel.load_checkpoint_state(self.optimizer, tensors, optimizer_state["param_groups"])
        else:
            self.optimizer.load_state_dict(optimizer_state["optimizer"])
        self.scheduler.load_state_dict(optimizer_state["scheduler"])
        self.producer.load_state_dict({**state, "rng": rng_state["trainer"]})
        if "learner" in rng_state and self.update_rng is not self.producer.rng:  # else: its own stream starts
            self.update_rng.set_state(rng_state["learner"])
        torch.set_rng_state(rng_state["torch"])
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.accountant.load_state_dict(state["accounting"])
        self.updater.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        set_python_random_state(state["python_random"])
        self.health.load_state_dict(state.get("health", {}))
        if "cuda" in rng_state and torch.cuda.is_available() and len(rng_state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng_state["cuda"])
        self.dropped_batches = state.get("dropped_batches", 0)
        written = state.get("world_size")  # absent from checkpoints of older versions: not known, nothing said
        if written is not None and written != self.dist.world_size and self.dist.is_main:  # one line for the job
            log.warning(world_size_change(written, self.dist.world_size))
        saved = in_flight_on_resume(path, self.cfg.train.asynchronous.enabled, self.step)
        self.generator_start = load_generator(path)
        return [ProducedBatch.from_state(b) for b in saved]
