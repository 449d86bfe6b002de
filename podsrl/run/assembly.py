"""A run's parts, built once at start-up and handed to the loop (podsrl/run/trainer.py) as one frozen set: the policy
and its reference, the task, the rollout engines, the update, the producer of batches and the compute accounting,
with the facts resolved for this run (podsrl/config/facts.py) and the micro-batch optim.micro_batch_size=auto
decides. The config stays as loaded. The order of the builds is the order of the random draws a run's bits
depend on: the seeds are set first, then the models load, then everything else."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from podsrl.build import load_model, load_task, reward_manager, rollout_engine, verifier
from podsrl.config import Config
from podsrl.config.facts import RunFacts, run_facts, unread_settings
from podsrl.distributed import DistContext
from podsrl.engines import RolloutEngine
from podsrl.episodes.runner import task_episodes
from podsrl.fsdp import build_data_parallel, fsdp_sharding
from podsrl.methods import METHODS
from podsrl.models.loading import count_parameters
from podsrl.models.transformers_api import model_context
from podsrl.run.accounting import ComputeAccountant
from podsrl.run.async_generation import async_engines
from podsrl.run.checkpoint import prepare_run_dir, resume_checkpoint
from podsrl.run.engine_state import keeps_engine_state
from podsrl.run.micro_batch import resolve_micro_batch
from podsrl.run.producer import BatchProducer
from podsrl.run.warmup import base_weights, resume_base_weights
from podsrl.update import PolicyUpdater, UpdateSettings
from podsrl.update.optimizer import build_optimizer

log = logging.getLogger("podsrl")

LEARNER_SEED_OFFSET = 0x1EA2  # train.async: the learner's own RNG stream (mini-batch order), apart from the generator's


@dataclass(frozen=True)
class Start:
    """Where a run starts from: its facts, the checkpoint a resume continues (None: the beginning) and the weights
    the policy starts from before it (the base model, or its warm-up)."""
    facts: RunFacts
    checkpoint: Path | None
    skipped_checkpoints: list[dict]  # checkpoints a resume passed over as damaged ({path, reason}), newest first
    base_path: Any


@dataclass(frozen=True)
class Models:
    model: torch.nn.Module  # the trained policy (FSDP2 under torchrun: this rank's shards)
    ref_model: torch.nn.Module | None  # the frozen starting policy (None: beta = 0, or LoRA's disabled adapters)
    tokenizer: Any
    data_parallel: Any  # podsrl.distributed.DataParallel under torchrun, else None
    generation_model: torch.nn.Module  # the engines' (unsharded) policy: the policy itself in one process

    @property
    def sharded(self) -> bool:
        """FSDP2: every rank holds its own shards of the weights and optimiser state."""
        return self.data_parallel is not None and self.data_parallel.sharded


@dataclass(frozen=True)
class Engines:
    engine: RolloutEngine  # samples the training batches
    eval_engine: RolloutEngine  # samples the eval set: the training engine, unless train.async
    eval_tokenizer: Any
    generator_model: torch.nn.Module | None  # train.async: the generator's own copy of the policy


@dataclass(frozen=True)
class RunParts(Start, Models, Engines):
    """Everything the loop steps with: the fields of Start, Models and Engines (each built by one function below),
    then these. The loop's own state (step, clocks, the generator thread) is the trainer's."""
    task: Any
    eval_problems: list
    micro_batch: int  # optim.micro_batch_size as this run takes it (auto decided on this device)
    keep_engine_state: bool  # the engine's decode state stays through each update (podsrl/run/engine_state.py)
    eval_episodes: Any  # a task with an environment is evaluated on episodes, as it trains (else None)
    verify: Any  # the task's verifier through the reward manager (eval)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    updater: PolicyUpdater
    producer: BatchProducer
    accountant: ComputeAccountant
    update_rng: torch.Generator  # mini-batch order and the gradient-noise probe


def assemble(cfg: Config, dist: DistContext, run_dir: Path, resume: bool) -> RunParts:
    """The run's parts on this rank, from `cfg` as loaded (and the checkpoint of `run_dir` to resume, if asked)."""
    start = start_run(cfg, dist, run_dir, resume)
    models = build_models(cfg, dist, start)
    task, eval_problems = load_task(cfg, models.tokenizer, models.model)
    if not eval_problems:
        log.warning("no eval set (task %s): training without held-out evaluation", task.name)
    engines = build_engines(cfg, dist, models, start.facts)
    generation_model, tokenizer = models.generation_model, models.tokenizer
    micro_batch = resolve_micro_batch(cfg, generation_model, task, tokenizer, dist.device, dist.world_size,
                                      dist.is_main)
    keep_engine_state = keeps_engine_state(cfg, micro_batch, engines.engine, generation_model, task, tokenizer,
                                           dist.device, dist.world_size, dist.is_main)
    context = model_context(generation_model)
    eval_episodes = task_episodes(engines.eval_engine, engines.eval_tokenizer, task, cfg.episode, context)
    rewards = reward_manager(cfg, task)
    verify = verifier(rewards, task)
    method = METHODS[cfg.method](cfg)
    optimizer, scheduler = build_optimizer(cfg, models.model, models.sharded)
    updater = PolicyUpdater(models.model, optimizer, scheduler, UpdateSettings.of(cfg, micro_batch_size=micro_batch),
                            start.facts, models.ref_model, modulation=method.token_modulation(),
                            data_parallel=models.data_parallel)
    producer = BatchProducer(cfg, task, tokenizer, engines.engine, rewards, method,
                             sampler_logprobs=updater.needs_sampler_logprobs, context=context)
    # mini-batch order and the probe: the producer's stream when the two sides take turns (synchronous,
    # staleness 0), else the learner's own
    update_rng = (torch.Generator().manual_seed(cfg.seed + LEARNER_SEED_OFFSET) if start.facts.overlap
                  else producer.rng)
    return RunParts(**vars(start), **vars(models), **vars(engines), task=task, eval_problems=eval_problems,
                    micro_batch=micro_batch, keep_engine_state=keep_engine_state, eval_episodes=eval_episodes,
                    verify=verify, optimizer=optimizer, scheduler=scheduler, updater=updater, producer=producer,
                    accountant=ComputeAccountant(count_parameters(generation_model)), update_rng=update_rng)


def start_run(cfg: Config, dist: DistContext, run_dir: Path, resume: bool) -> Start:
    """The run directory prepared, the seeds set, the facts resolved and the checkpoint and weights to start from."""
    prepare_run_dir(run_dir, resume)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    facts = run_facts(cfg, dist.device)
    unread = unread_settings(cfg)
    if unread and dist.is_main:
        log.warning("settings nothing in this run reads (method: %s reads only its own section): %s",
                    cfg.method, ", ".join(unread))
    checkpoint, skipped = resume_checkpoint(run_dir) if resume else (None, [])
    if resume and checkpoint is None:
        log.warning("no checkpoint in %s (none saved yet): starting from the beginning", run_dir)
    with dist.main_first():  # a resume reads the warm-up only where the checkpoint does not replace it
        base_path = (resume_base_weights(cfg, checkpoint, cfg.log.progress) if checkpoint is not None
                     else base_weights(cfg, progress=cfg.log.progress))
    return Start(facts=facts, checkpoint=checkpoint, skipped_checkpoints=skipped, base_path=base_path)


def build_models(cfg: Config, dist: DistContext, start: Start) -> Models:
    """The policy (from the checkpoint on a resume), its reference and the engines' copy, on this rank's device."""
    # FSDP2 under torchrun: policy and reference go straight into their shards as they load (no rank holds
    # either whole), the reference before anything else is built
    sharding = fsdp_sharding(dist, cfg, start.facts.compute_dtype)
    model, tokenizer = load_model(cfg, start.checkpoint / "model" if start.checkpoint else None, start.base_path,
                                  trainable=True, ctx=dist, shard=sharding.shard if sharding else None)
    ref_model = None
    # frozen copy of the starting policy; not loaded at all when beta = 0, nor with LoRA (the policy with its
    # adapters disabled is the starting policy: podsrl/update/updater.py reference_logprobs)
    if cfg.algo.beta > 0 and cfg.model.lora_rank == 0:
        ref_model, _ = load_model(cfg, None, start.base_path, trainable=False, ctx=dist,
                                  shard=(lambda m: sharding.shard(m.eval().requires_grad_(False)))
                                  if sharding else None)
        ref_model.eval().requires_grad_(False)
    if sharding is None:
        model.to(dist.device)
        if ref_model is not None:
            ref_model.to(dist.device)
    # torchrun: DDP-style, or FSDP2 over the shards (so before the optimiser), which keeps an unsharded copy for
    # the engines; in one process the engines use the policy itself.
    data_parallel = build_data_parallel(dist, model, ref_model, cfg, start.facts, sharding)
    generation_model = data_parallel.generation_model if data_parallel else model
    return Models(model=model, ref_model=ref_model, tokenizer=tokenizer, data_parallel=data_parallel,
                  generation_model=generation_model)


def build_engines(cfg: Config, dist: DistContext, models: Models, facts: RunFacts) -> Engines:
    """The training engine and the eval engine: one and the same, unless train.async samples on a copy of its own."""
    if not cfg.train.asynchronous.enabled:
        engine = dist.wrap_engine(rollout_engine(cfg, models.generation_model, models.tokenizer,
                                                 facts.compute_dtype))
        return Engines(engine=engine, eval_engine=engine, eval_tokenizer=models.tokenizer, generator_model=None)
    generator_model, engine, eval_engine, eval_tokenizer = async_engines(
        cfg, models.generation_model, models.tokenizer, dist.enabled, facts.compute_dtype)
    return Engines(engine=engine, eval_engine=eval_engine, eval_tokenizer=eval_tokenizer,
                   generator_model=generator_model)
