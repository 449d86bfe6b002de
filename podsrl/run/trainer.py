"""The training loop, top to bottom: the learner. One step takes its batch from the producer (podsrl/run/producer.py:
problems -> collect -> select -> refill -> advantage clip, the method's stages), then updates on it, then evals,
logs and checkpoints when due. The parts it steps with are built once before the first step (podsrl/run/assembly.py
assemble: a frozen RunParts); what changes as it runs (the step, the clocks, the generator thread) is its own. This
file names no method.

Synchronously the producer runs in process before each update; with `train.async` it runs ahead on the background
generator's thread (podsrl/run/async_generation.py) while the learner updates, and the learner reads it only once that
thread is quiet.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from podsrl import threads, waits
from podsrl.batch import RolloutBatch
from podsrl.config import Config, dump_config
from podsrl.distributed import NullLogger, init_distributed
from podsrl.engines.capture_lock import CAPTURE_LOCK
from podsrl.episodes.calls import CALLS, Interrupted
from podsrl.errors import WorkerLost
from podsrl.models.loading import resolve_device
from podsrl.reporting.tracking import build_metrics_logger, build_progress, read_metrics
from podsrl.run import faults
from podsrl.run.assembly import assemble
from podsrl.run.async_generation import BackgroundGenerator, split_threads, staleness_metrics
from podsrl.run.description import describe_checkpoint_size, describe_run
from podsrl.run.evaluation import evaluate
from podsrl.run.health import HealthMonitor
from podsrl.run.learner_state import Position, Restored, restore_learner, save_learner
from podsrl.run.lock import RunLock
from podsrl.run.log import RankLog
from podsrl.run.producer import ProducedBatch, StepRecord
from podsrl.run.stop import StopSignals
from podsrl.run.summary import run_summary, write_run_outputs

log = logging.getLogger("podsrl")


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
            self.parts = assemble(cfg, self.dist, self.run_dir, resume)
            self._start()
        except BaseException:
            self._release_run_dir()
            raise

    def _start(self) -> None:
        """The learner's state at its first step: the beginning, or the checkpoint the parts resume from."""
        cfg, parts = self.cfg, self.parts
        self.generator: BackgroundGenerator | None = None
        self.stop, self.stopped_by_signal = StopSignals(self.dist.enabled), False
        self.health = HealthMonitor(cfg.train, speak=self.dist.is_main)
        restored = (restore_learner(parts, self.health, self.dist, cfg.train.asynchronous.enabled)
                    if parts.checkpoint is not None else Restored(Position(), in_flight=[], generator_start=None))
        at = restored.position
        self.step, self.elapsed, self.dropped_batches = at.step, at.elapsed, at.dropped_batches
        if parts.checkpoint is not None:
            log.info("resumed %s at step %d", self.run_dir, self.step)
        self.saved_step = self.step  # the step of the newest checkpoint (0: none, or the start)
        if cfg.train.asynchronous.enabled:
            self._build_generator(restored.in_flight, restored.generator_start)
        log.info(describe_run(cfg, parts.facts, self.dist, parts.generation_model, parts.engine.name))
        log.info(describe_checkpoint_size(cfg, parts.model, parts.generation_model, parts.sharded))
        if self.dist.is_main:
            dump_config(cfg, self.run_dir / "config.yaml")  # as loaded: optim.micro_batch_size=auto stays 0
        self.logger = (build_metrics_logger(cfg, self.run_dir, self.step if parts.checkpoint is not None else None)
                       if self.dist.is_main else NullLogger())

    def _build_generator(self, in_flight: list[ProducedBatch], start: dict | None) -> None:
        """train.async: the generator thread, from the step and in-flight batches of a resume (if any). In process
        it samples on its own torch threads: train.async.generator_threads, or half of the process's (the learner
        keeps the rest); the Ray pool's workers have theirs."""
        cfg, run_ahead, parts = self.cfg, self.cfg.train.asynchronous, self.parts
        self.threads = torch.get_num_threads()  # restored by close_engines
        generator_threads = split_threads(run_ahead.generator_threads) if cfg.rollout.engine_type.in_process else 0
        self.generator = BackgroundGenerator(parts.producer.produce, parts.generator_model, parts.engine,
                                             run_ahead.max_staleness, self.step, cfg.train.max_steps, in_flight,
                                             threads=generator_threads, start=start)
        self.dropped_batches += self.generator.dropped

    # ------------------------------------------------------------------------------------------- one step

    def train_step(self) -> StepRecord:
        t0, cpu0 = time.perf_counter(), time.process_time()
        threads.fit_threads_to_load()  # no more torch threads than the cores other work leaves free
        waits.at_step(self.step + 1)  # named by a wait that expires in it
        faults.fire("step", self.step + 1)
        if self.generator is None:
            produced, waited = self.parts.producer.produce(self.step), 0.0
        else:  # w_step for the batches that need it, then this step's batch (produced ahead, or waited for)
            self.generator.publish(self.step, self.parts.generation_model)
            produced, waited = self.generator.take(self.step)
        kept = self.dist.agree_batch(produced.kept, self.parts.update_rng)
        # the update's memory, not the engine's kept cache, unless the plan counts it (train.async: in flight)
        if self.generator is None and not self.parts.keep_engine_state:
            self.parts.engine.release()
        t_upd = time.perf_counter()
        update_metrics = self._update(kept)
        timers = {**produced.timers, "time/update": time.perf_counter() - t_upd}
        if self.generator is not None:
            timers.update({"time/learner_wait": waited, "time/generator_idle": produced.generator_idle})
        step_time = time.perf_counter() - t0
        self.elapsed += time.process_time() - cpu0 if self.cfg.train.clock == "cpu" else step_time
        self.step += 1
        self.health.stop_if_nonfinite(self.parts.updater.nonfinite_in_a_row, self.step, self.run_dir / "checkpoints")
        return StepRecord(metrics=self._step_metrics(produced, kept, update_metrics, timers, step_time),
                          timers=timers, generated=produced.generated)

    def _update(self, kept: RolloutBatch) -> dict:
        """The policy update on the step's kept batch, then the engines' weights follow it; the update's metrics."""
        parts = self.parts
        if faults.fire("loss", self.step + 1):  # injected numerical fault: a NaN loss and gradient
            kept.advantages = torch.full_like(kept.advantages, float("nan"))
            if kept.token_advantages is not None:
                kept.token_advantages = torch.full_like(kept.token_advantages, float("nan"))
        with CAPTURE_LOCK:  # train.async: the generator thread captures no decode-step graph while this runs
            metrics = parts.updater.update(kept.trim_padding(), parts.update_rng) if kept.num_rollouts else {}
            parts.optimizer.zero_grad(set_to_none=True)  # the gradients' memory is free for the next generation
            if parts.data_parallel is not None:  # FSDP2: gathers the updated shards into the generation copy
                parts.data_parallel.sync_generation_model()
            if self.generator is None:
                parts.engine.sync_weights(parts.generation_model)
        return metrics

    def _step_metrics(self, produced: ProducedBatch, kept: RolloutBatch, update_metrics: dict, timers: dict,
                      step_time: float) -> dict[str, float]:
        metrics = {"step": self.step, **produced.metrics}
        metrics.update(update_metrics)
        metrics.update(self.parts.accountant.step(
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
        return not self.stop.requested and not self._budget_spent()

    def run_eval(self) -> dict:
        cfg, parts = self.cfg, self.parts
        if not parts.eval_problems:
            return {}
        self._settle_generator()  # train.async: no generation beside the eval (a run ended by its time budget)
        t0 = time.perf_counter()
        if parts.eval_engine is not parts.engine:  # train.async: its weights copy (if any) follows the learner's
            parts.eval_engine.sync_weights(parts.generation_model)
        metrics = evaluate(parts.eval_engine, parts.eval_tokenizer, parts.eval_problems, parts.verify,
                           cfg.rollout.max_new_tokens, cfg.eval.samples, cfg.rollout.temperature,
                           cfg.rollout.top_p, cfg.eval.batch_size, parts.eval_episodes)
        # under train.async the eval engine idles beside the update until the next eval: freed; the training
        # engine's state the plan keeps through the update (its rows bounded by the plan's) stays, graphs and all
        if parts.eval_engine is not parts.engine or not parts.keep_engine_state:
            parts.eval_engine.release()
        # eval is outside the training clock (time/elapsed); its own cost is logged beside it
        record = {"step": self.step, "time/elapsed": self.elapsed, "time/eval": time.perf_counter() - t0, **metrics}
        record.update(parts.accountant.total_metrics())
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
        progress = build_progress(self.cfg, self.cfg.train.max_steps, self.dist.is_main, start=self.step)
        last_eval: dict = {}
        try:
            with self.stop:
                try:
                    last_eval = self._train_loop(progress)
                except Interrupted:
                    # A signal abandoned the episodes in flight (an environment or tool may never return): the
                    # last completed step is what a resume continues from, its checkpoint written now if not yet.
                    if self.step > self.saved_step:
                        self.save()
        finally:
            progress.close()
            self.close()
        if self.stop.requested and not self._budget_spent():
            log.warning("stopped by signal at step %d; resume with --resume %s", self.step, self.run_dir)
            self.stopped_by_signal = True
            return last_eval
        summary = run_summary(self.cfg, self.parts, self.step, self.elapsed, last_eval, self.health.warnings)
        if self.dist.is_main:
            write_run_outputs(self.cfg, self.parts, self.run_dir, summary)
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
            self.health.warn_if_slow(self.elapsed, self.step)
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
        engine, eval_engine = self.parts.engine, self.parts.eval_engine
        engine.close()
        if eval_engine is not engine:
            eval_engine.close()

    def _budget_spent(self) -> bool:
        """The run's own end (steps, seconds or rollouts), as opposed to a stop requested by a signal."""
        t = self.cfg.train
        return (self.step >= t.max_steps or bool(t.max_seconds and self.elapsed >= t.max_seconds)
                or bool(t.max_rollouts and self.parts.accountant.totals["rollouts_generated"] >= t.max_rollouts))

    def _logged_eval(self) -> dict:
        """The eval metrics already logged at the current step (kept on resume), or {}."""
        records = [r for r in read_metrics(self.logger.path) if r.get("step") == self.step and "eval/accuracy" in r]
        return {k: v for k, v in records[-1].items() if k.startswith("eval/")} if records else {}

    # ------------------------------------------------------------------------------------------- checkpoints

    def save(self) -> None:
        """Writes the step's checkpoint: the weights and the learner's state (podsrl/run/learner_state.py)."""
        save_learner(self.parts, self.run_dir, Position(self.step, self.elapsed, self.dropped_batches), self.health,
                     self.dist, self.cfg.train.keep_checkpoints, self.generator)
        self.saved_step = self.step
