"""The training loop, top to bottom:

    prompts -> allocate -> generate -> score -> select -> advantages -> update -> (eval, log, checkpoint)

Each stage is a function or registry entry chosen by config; this file only moves one batch through them.
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import time
from pathlib import Path

import torch

from podsrl import faults
from podsrl.accounting import ComputeAccountant
from podsrl.algo.advantages import group_mean_std
from podsrl.algo.modulation import dynamo_modulation
from podsrl.batch import Problem, RolloutBatch, concat_batches
from podsrl.checkpoint import (
    latest_checkpoint,
    load_checkpoint_files,
    load_sharded_tensors,
    prepare_run_dir,
    save_checkpoint,
)
from podsrl.config import Config, dump_config
from podsrl.distributed import NullLogger, init_distributed
from podsrl.engines import SamplingParams, build_engine
from podsrl.errors import UserError
from podsrl.evaluation import evaluate
from podsrl.fileio import write_text_atomic
from podsrl.models import count_parameters, load_policy, resolve_device
from podsrl.plotting import plot_run
from podsrl.rewards import RewardManager, build_reward_manager
from podsrl.select.aero import collect_aero_rollouts
from podsrl.select.downsample import zero_variance_groups
from podsrl.select.prompt_stats import PromptStats
from podsrl.stages import rollout_counts, select_for_update
from podsrl.tasks import build_task
from podsrl.tracking import MetricsLogger, StepProgress, read_metrics
from podsrl.update import PolicyUpdater
from podsrl.warmup import needs_warmup, run_warmup

log = logging.getLogger("podsrl")


def lr_lambda(cfg: Config, total_updates: int):
    warm, kind = cfg.optim.warmup_steps, cfg.optim.scheduler

    def f(update: int) -> float:
        if update < warm:
            return (update + 1) / warm
        if kind == "cosine":
            progress = min(1.0, (update - warm) / max(1, total_updates - warm))
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return f


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        prepare_run_dir(self.run_dir, resume)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.dist = init_distributed(resolve_device(cfg.model.device))  # torchrun: this rank's place and device
        self.device = self.dist.device
        checkpoint = latest_checkpoint(self.run_dir) if resume else None
        if resume and checkpoint is None:
            log.warning("no valid checkpoint in %s: starting from the beginning", self.run_dir)
        with self.dist.main_first():
            base = str(run_warmup(cfg, progress=cfg.log.progress)) if needs_warmup(cfg) else None
        self.base_path = base
        if cfg.model.lora_rank > 0:  # base weights frozen; checkpoints hold the adapter alone
            from podsrl.lora import apply_lora, load_adapter

            self.model, self.tokenizer = load_policy(cfg.model, base, seed=cfg.seed)
            m = cfg.model
            self.model = (load_adapter(self.model, checkpoint / "model", trainable=True) if checkpoint else
                          apply_lora(self.model, m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules))
        else:
            self.model, self.tokenizer = load_policy(
                cfg.model, str(checkpoint / "model") if checkpoint else base, seed=cfg.seed
            )
        self.model.to(self.device)
        self.ref_model = None
        if cfg.algo.beta > 0:  # frozen copy of the starting policy; not loaded at all when beta = 0
            self.ref_model, _ = load_policy(cfg.model, base, seed=cfg.seed)
            self.ref_model.to(self.device).eval().requires_grad_(False)
        # torchrun: DDP-style, or FSDP2 which shards policy and reference in place (so before the optimiser) and
        # keeps an unsharded copy for the engines; in one process the engines use the policy itself.
        self.data_parallel = self.dist.data_parallel(
            self.model, self.ref_model, cfg.train, torch.device("cpu") if cfg.rollout.engine == "ray" else None)
        self.generation_model = self.data_parallel.generation_model if self.data_parallel else self.model
        self.task = build_task(cfg.task, self.tokenizer)
        self.eval_problems = self.task.eval_set()[: cfg.eval.size or None]
        self.engine = self.dist.wrap_engine(
            build_engine(cfg.rollout.engine, self.generation_model, self.tokenizer, **cfg.rollout.engine_options))
        self.rewards = build_reward_manager(
            cfg.rewards or list(self.task.default_rewards), self.task, cfg.reward_on_error, cfg.reward_timeout
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           weight_decay=cfg.optim.weight_decay)
        total_updates = cfg.train.max_steps * cfg.optim.epochs * cfg.optim.mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_updates))
        self.updater = PolicyUpdater(self.model, self.optimizer, self.scheduler, cfg, self.device, self.ref_model,
                                     modulation=self._modulation(), data_parallel=self.data_parallel)
        self.stats = PromptStats()
        self.accountant = ComputeAccountant(count_parameters(self.generation_model))
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.step, self.data_position, self.elapsed = 0, 0, 0.0
        self.stop_requested = False
        if checkpoint is not None:
            self._restore(checkpoint)
            log.info("resumed %s at step %d", self.run_dir, self.step)
        if self.dist.is_main:
            dump_config(cfg, self.run_dir / "config.yaml")
        self.logger = (MetricsLogger(self.run_dir, cfg.log.tensorboard,
                                     resume_step=self.step if checkpoint is not None else None)
                       if self.dist.is_main else NullLogger())

    # ------------------------------------------------------------------------------------------- stages

    def _modulation(self):
        """Token-level advantage modulation (DynaMO) as a closure over its config, or None."""
        if self.cfg.algo.modulation == "none":
            return None
        d, a = self.cfg.dynamo, self.cfg.algo

        def modulate(advantages, log_ratio, logprobs, entropy, mask):
            return dynamo_modulation(advantages, log_ratio, logprobs, entropy, mask, a.epsilon_low, a.epsilon_high,
                                     lambda_min=d.lambda_min, gamma=d.gamma, tau=d.tau, mu_max=d.mu_max,
                                     stabilize=d.stabilize, compensate=d.compensate)

        return modulate

    def next_problems(self, count: int) -> list[Problem]:
        problems = [self.task.problem(self.data_position + i) for i in range(count)]
        self.data_position += count
        return problems

    def sampling_params(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, return_logprobs=self.cfg.optim.epochs * self.cfg.optim.mini_batches > 1)

    def generate_and_score(self, problems: list[Problem], indices: list[int], counts: list[int]) -> RolloutBatch:
        """Sample counts[j] rollouts of problems[indices[j]] and score them; group_index refers to `problems`."""
        t0 = time.perf_counter()
        prompts = [self.tokenizer(problems[i].prompt, add_special_tokens=False).input_ids for i in indices]
        seeds = torch.randint(0, 2**62, (sum(counts),), generator=self.rng)
        out = self.engine.generate(prompts, counts, self.sampling_params(), seeds)
        t1 = time.perf_counter()
        index_map = torch.tensor(indices, dtype=torch.long)
        batch = RolloutBatch(
            problems=problems, group_index=index_map[out.group_index], prompt_ids=out.prompt_ids,
            prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
            completion_mask=out.completion_mask.float(), truncated=out.truncated, old_logprobs=out.logprobs,
        )
        ids = batch.completion_ids.masked_fill(batch.completion_mask == 0, self.tokenizer.pad_token_id)
        batch.completions = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        result = self.rewards.score(problems, batch.group_index, batch.completions)
        batch.rewards, batch.reward_components, batch.correct = result.rewards, result.components, result.correct
        if not bool(result.valid.all()):  # reward policy 'skip': those rollouts never reach the update
            self._skipped[0] += int((~result.valid).sum())  # ... but were generated: they count as compute
            self._skipped[1] += int(batch.completion_mask[~result.valid].sum())
            batch = batch.select_rows(result.valid)
        self._timers["time/generate"] += t1 - t0
        self._timers["time/score"] += time.perf_counter() - t1
        self._reward_metrics.append(result.metrics)
        return batch

    def collect(self, problems: list[Problem]) -> RolloutBatch:
        """Generate and score this step's rollouts: n each, DynaMO's allocation, or AERO's rounds."""
        cfg = self.cfg
        if cfg.select.rule == "aero":
            a = cfg.aero
            batch, metrics = collect_aero_rollouts(
                len(problems), lambda idx, counts: self.generate_and_score(problems, idx, counts),
                n_explore=a.n_explore, n_extra=a.n_extra, n_max=a.n_max, pad_token_id=self.tokenizer.pad_token_id)
        else:
            counts, metrics = rollout_counts(cfg, self._allocation_stats(), [p.uid for p in problems])
            batch = self.generate_and_score(problems, list(range(len(problems))), counts)
        self._collect_metrics.append(metrics)
        return batch

    def _allocation_stats(self) -> PromptStats:
        """Statistics the allocation reads: live (refresh=step) or a snapshot taken at each epoch start."""
        if self.cfg.dynamo.refresh == "step" or self.cfg.rollout.allocation == "uniform":
            return self.stats
        epoch_size = len(self.task) if hasattr(self.task, "__len__") else 0
        if not epoch_size:
            raise UserError("dynamo.refresh: 'epoch' needs a finite training set (a dataset task, or "
                            "task.args.train_size for the arithmetic task); use 'step' for this task")
        epoch = self.data_position // epoch_size
        if getattr(self, "_snapshot_epoch", None) != epoch:
            self._snapshot_epoch, self._snapshot = epoch, PromptStats()
            self._snapshot.load_state_dict(self.stats.state_dict())
        return self._snapshot

    def select(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict]:
        """The rollouts that enter the update (PODS rule or AERO), with their advantages."""
        t0 = time.perf_counter()
        kept, metrics = select_for_update(self.cfg, batch, self.stats, self.rng)
        self._timers["time/select"] += time.perf_counter() - t0
        return kept, metrics

    def select_with_filter(self, problems: list[Problem]) -> tuple[RolloutBatch, dict]:
        """Collect + select, dropping zero-variance groups and refilling with new prompts (bounded) if asked."""
        cfg = self.cfg
        batch = self.collect(problems)
        self._update_stats(batch)
        kept, metrics = self.select(batch)
        if not cfg.select.filter_zero_variance:
            return kept, metrics
        parts, live_groups, rounds = [], 0, 0
        while True:
            dead = zero_variance_groups(kept.rewards, kept.group_index, kept.num_groups)
            kept = kept.select_rows(~dead[kept.group_index])
            live_groups += int((~dead & (kept.group_sizes() > 0)).sum())
            parts.append(kept)
            missing = cfg.rollout.prompts_per_step - live_groups
            if missing <= 0 or rounds >= cfg.select.max_refill_rounds:
                break
            rounds += 1
            extra = self.collect(self.next_problems(missing))
            self._update_stats(extra)
            kept, _ = self.select(extra)
        metrics["select/refill_rounds"] = float(rounds)
        metrics["select/groups_trained"] = float(live_groups)
        # Bound hit with too few informative groups: train on what there is, and say so.
        metrics["select/refill_exhausted"] = float(live_groups < cfg.rollout.prompts_per_step)
        return concat_batches(parts, self.tokenizer.pad_token_id, disjoint=True), metrics

    def _update_stats(self, batch: RolloutBatch) -> None:
        self.stats.update_from_groups([p.uid for p in batch.problems], batch.group_index, batch.correct)
        self._generated.append(batch)

    # ------------------------------------------------------------------------------------------- loop

    def train_step(self) -> dict:
        cfg = self.cfg
        self._timers = {k: 0.0 for k in ("time/generate", "time/score", "time/select", "time/update")}
        self._reward_metrics: list[dict] = []
        self._collect_metrics: list[dict] = []
        self._generated: list[RolloutBatch] = []
        self._skipped = [0, 0]  # rollouts and tokens generated, then dropped by the reward policy 'skip'
        t0 = time.perf_counter()
        faults.fire("step", self.step + 1)
        problems = self.next_problems(cfg.rollout.prompts_per_step)
        kept, select_metrics = self.select_with_filter(problems)
        kept = self.dist.agree_batch(kept, self.rng)
        t_upd = time.perf_counter()
        if faults.fire("loss", self.step + 1):  # injected numerical fault: a NaN loss and gradient
            kept.advantages = torch.full_like(kept.advantages, float("nan"))
        update_metrics = self.updater.update(kept.trim_padding(), self.rng) if kept.num_rollouts else {}
        if self.data_parallel is not None:  # FSDP2: gathers the updated shards into the generation copy
            self.data_parallel.sync_generation_model()
        self.engine.sync_weights(self.generation_model)
        self._timers["time/update"] = time.perf_counter() - t_upd
        step_time = time.perf_counter() - t0
        self.elapsed += step_time
        self.step += 1
        if self.updater.nonfinite_in_a_row >= cfg.train.max_nonfinite_steps:
            raise UserError(f"training stopped: {self.updater.nonfinite_in_a_row} consecutive steps with a "
                            f"non-finite loss or gradient (step {self.step}); try a lower optim.lr. The last good "
                            f"checkpoint is in {self.run_dir / 'checkpoints'}")
        return self._step_metrics(kept, select_metrics, update_metrics, step_time)

    def _step_metrics(self, kept: RolloutBatch, select_metrics: dict, update_metrics: dict, step_time: float):
        generated = self._generated
        rewards = torch.cat([b.rewards for b in generated])
        lengths = torch.cat([b.completion_lengths() for b in generated]).float()
        zero_std = torch.cat([zero_variance_groups(b.rewards, b.group_index, b.num_groups) for b in generated])
        group_std = torch.cat([group_mean_std(b.rewards, b.group_index, b.num_groups)[1] for b in generated])
        metrics = {
            "step": self.step,
            "reward": float(rewards.mean()),
            "reward_std": float(group_std.mean()),
            "frac_reward_zero_std": float(zero_std.float().mean()),
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(torch.cat([b.truncated for b in generated]).float().mean()),
            "correct": float(torch.cat([b.correct for b in generated]).float().mean()),
        }
        for parts in (self._reward_metrics, self._collect_metrics):
            for part in parts:
                for k, v in part.items():
                    metrics[k] = metrics.get(k, 0.0) + v / len(parts)
        metrics.update(select_metrics)
        metrics.update(update_metrics)
        metrics.update(self.accountant.step(
            generated_rollouts=int(rewards.numel()) + self._skipped[0],
            generated_tokens=int(lengths.sum()) + self._skipped[1],
            trained_rollouts=kept.num_rollouts, trained_tokens=int(kept.completion_mask.sum()),
            passes=self.cfg.optim.epochs,
        ))
        metrics.update(self._timers)
        metrics["time/step"] = step_time
        metrics["time/elapsed"] = self.elapsed
        return metrics

    def budget_left(self) -> bool:
        t = self.cfg.train
        if self.step >= t.max_steps or self.stop_requested:
            return False
        if t.max_seconds and self.elapsed >= t.max_seconds:
            return False
        if t.max_rollouts and self.accountant.totals["rollouts_generated"] >= t.max_rollouts:
            return False
        return True

    def verify(self, problems: list[Problem], group_index: torch.Tensor, completions: list[str]) -> torch.Tensor:
        # Correctness is the `correct` reward alone: other (possibly faulty or costly) rewards play no part.
        specs = [s for s in self.rewards.specs if s.name == "correct"]
        if not specs:
            return torch.zeros(len(completions), dtype=torch.bool)
        manager = RewardManager(specs, self.task, self.rewards.on_error, self.rewards.timeout_s)
        return manager.score(problems, group_index, completions).correct

    def run_eval(self) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        metrics = evaluate(self.engine, self.tokenizer, self.eval_problems, self.verify,
                           cfg.rollout.max_new_tokens, cfg.eval.samples, cfg.rollout.temperature,
                           cfg.rollout.top_p, cfg.eval.batch_size)
        # eval is outside the training clock (time/elapsed); its own cost is logged beside it
        record = {"step": self.step, "time/elapsed": self.elapsed, "time/eval": time.perf_counter() - t0, **metrics}
        record.update(self.accountant.total_metrics())
        self.logger.log(record)
        return metrics

    def train(self) -> dict:
        cfg = self.cfg
        progress = StepProgress(cfg.train.max_steps, cfg.log.progress and self.dist.is_main, start=self.step)
        previous = {s: signal.signal(s, self._request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        last_eval: dict = {}
        try:
            if self.step == 0:
                last_eval = self.run_eval()
                progress.update(0, accuracy=last_eval["eval/accuracy"])
            elif not self.dist.agree(self.budget_left()):  # resumed after the last step: needs its final eval
                last_eval = self._logged_eval() or self.run_eval()
            while self.dist.agree(self.budget_left()):
                metrics = self.train_step()
                self.logger.log(metrics)
                progress.update(self.step, reward=metrics["reward"], step_time=metrics["time/step"])
                finished = not self.dist.agree(self.budget_left())
                # Stopped by a signal: checkpoint at once (a grace period may be short), no extra eval record.
                if self.step % cfg.train.eval_every == 0 or self.dist.agree(self._budget_spent()):
                    last_eval = self.run_eval()
                    progress.update(self.step, accuracy=last_eval["eval/accuracy"])
                if self.step % cfg.train.save_every == 0 or finished:
                    self.save()
        finally:
            progress.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.logger.close()
            self.engine.close()
            self.dist.close()
        if self.stop_requested and not self._budget_spent():
            log.warning("stopped by signal at step %d; resume with --resume %s", self.step, self.run_dir)
            return last_eval
        summary = {"step": self.step, "time/elapsed": self.elapsed, **last_eval,
                   **self.accountant.total_metrics()}
        if self.dist.is_main:
            if cfg.model.lora_rank > 0:
                from podsrl.lora import export_merged

                export_merged(self.generation_model, self.run_dir / "merged", self.tokenizer)
            write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        if cfg.log.plot and self.dist.is_main:
            plot_run(self.run_dir)
        return summary

    def _request_stop(self, signum, frame) -> None:
        # Finish the step in flight, checkpoint, exit cleanly: nothing lost. A second Ctrl-C aborts at once.
        if self.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_requested = True

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

    # ------------------------------------------------------------------------------------------- state

    def save(self) -> None:
        sharded = self.data_parallel is not None and self.data_parallel.sharded
        if not self.dist.is_main and not sharded:  # every rank holds the same state (FSDP2: its own shards)
            return
        state = {
            "step": self.step, "data_position": self.data_position, "elapsed": self.elapsed,
            "prompt_stats": self.stats.state_dict(), "accounting": self.accountant.state_dict(),
            "nonfinite_in_a_row": self.updater.nonfinite_in_a_row, "python_random": _py_random_state(),
        }
        if getattr(self, "_snapshot", None) is not None:  # dynamo.refresh=epoch: the epoch-start statistics
            state["stats_snapshot"] = [self._snapshot_epoch, self._snapshot.state_dict()]
        optimizer_state = {"scheduler": self.scheduler.state_dict()}
        tensors = None
        if sharded:
            tensors, optimizer_state["param_groups"] = self.data_parallel.checkpoint_state(self.optimizer)
        else:
            optimizer_state["optimizer"] = self.optimizer.state_dict()
        rng_state = {"trainer": self.rng.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng_state["cuda"] = torch.cuda.get_rng_state_all()
        save_checkpoint(self.run_dir, self.step, self.generation_model, self.tokenizer, optimizer_state, rng_state,
                        state, keep=self.cfg.train.keep_checkpoints, sharded_tensors=tensors,
                        dist_ctx=self.dist if sharded else None)

    def _restore(self, path: Path) -> None:
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
        self.rng.set_state(rng_state["trainer"])
        torch.set_rng_state(rng_state["torch"])
        self.step, self.data_position, self.elapsed = state["step"], state["data_position"], state["elapsed"]
        self.stats.load_state_dict(state["prompt_stats"])
        self.accountant.load_state_dict(state["accounting"])
        self.updater.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        _set_py_random_state(state["python_random"])
        if "stats_snapshot" in state:
            self._snapshot_epoch, self._snapshot = state["stats_snapshot"][0], PromptStats()
            self._snapshot.load_state_dict(state["stats_snapshot"][1])
        if "cuda" in rng_state and torch.cuda.is_available() and len(rng_state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng_state["cuda"])


def _py_random_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _set_py_random_state(state: list) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))
