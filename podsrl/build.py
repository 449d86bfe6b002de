"""The parts of a run that `podsrl train` and `podsrl eval` build the same way: the policy (with LoRA), the task,
the rollout engine, the reward functions and the correctness check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from podsrl.batch import Problem
from podsrl.config import Config
from podsrl.distributed import DistContext
from podsrl.engines import RolloutEngine, build_engine
from podsrl.models.rank_loading import load_policy_on_ranks
from podsrl.models.sharded_loading import load_sharded
from podsrl.models.transformers_api import model_context
from podsrl.rewards import RewardManager, build_reward_manager
from podsrl.sandbox.box import SandboxLimits
from podsrl.sandbox.isolation import allow_unisolated, require_isolation
from podsrl.tasks import build_task
from podsrl.tasks.base import Task
from podsrl.tasks.prompt_length import limit_task_prompts

Verify = Callable[..., torch.Tensor]  # (problems, group_index, completions, environments=None) -> [R] bool


def load_model(cfg: Config, weights: str | Path | None, base: str | None, trainable: bool,
               ctx: DistContext | None = None, shard: Callable[[torch.nn.Module], None] | None = None):
    """(model, tokenizer). `weights` is a saved model directory: full weights, or a LoRA adapter when
    model.lora_rank > 0 (the adapter goes on top of `base`); None starts from `base` (a fresh adapter if
    `trainable` with LoRA). Under torchrun (`ctx`) rank 0 alone reads the model's weights: load_policy_on_ranks;
    with `shard` (FSDP2) each rank receives only its shards: sharded_loading.load_sharded."""
    m = cfg.model
    adapter = weights is not None and (Path(weights) / "adapter_config.json").is_file()
    lora = m.lora_rank > 0 and (trainable or adapter)
    if shard is not None and ctx is not None and ctx.enabled:
        adapt = None
        if lora:  # the other ranks wrap the architecture as rank 0's load does; the adapters' values are rank 0's
            from podsrl.lora import apply_lora

            def adapt(model):
                return apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules)
        return load_sharded(m, ctx, shard, str(weights) if weights is not None else base,
                            lambda: load_model(cfg, weights, base, trainable), adapt)
    if lora:  # base weights frozen; the adapter alone trains and is saved
        from podsrl.lora import apply_lora, load_adapter

        model, tokenizer = load_policy_on_ranks(m, base, cfg.seed, ctx)
        if weights is not None:
            return load_adapter(model, weights, trainable=trainable), tokenizer
        return apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules), tokenizer
    return load_policy_on_ranks(m, str(weights) if weights is not None else base, cfg.seed, ctx)


def load_task(cfg: Config, tokenizer, model: torch.nn.Module | None = None) -> tuple[Task, list[Problem]]:
    """The task and the held-out problems evaluated (eval.size of them; all when 0), with the prompt-length limit
    applied: checked against the model's context (when a model is given) before anything is generated."""
    allow_unisolated(cfg.episode.sandbox == "unisolated")
    task = build_task(cfg.task, tokenizer)
    if task.runs_programs:  # said (or refused) before anything is generated
        require_isolation(SandboxLimits.max_processes)
    # an episode's completion is the whole episode: model turns and environment messages, episode.max_tokens
    budget, key = ((cfg.episode.max_tokens, "episode.max_tokens") if task.has_environment() else
                   (cfg.rollout.max_new_tokens, "rollout.max_new_tokens"))
    limit_task_prompts(task, tokenizer, cfg.task.max_prompt_length, cfg.task.overlong_prompts, budget,
                       model_context(model) if model is not None else None, key)
    return task, task.eval_set()[: cfg.eval.size or None]


def rollout_engine(cfg: Config, model: torch.nn.Module, tokenizer, compute_dtype: torch.dtype) -> RolloutEngine:
    """The configured engine over `model`. An engine with a `compute_dtype_option` (the fast engine's weights_dtype)
    samples in `compute_dtype` (the run's, RunFacts.compute_dtype): a copy of the weights in that dtype when it is narrower than the parameters
    (bfloat16 sampling of float32 masters), refreshed after each update, unless rollout.engine_options sets that
    option itself."""
    options = dict(cfg.rollout.engine_options)
    option = cfg.rollout.engine_type.compute_dtype_option
    if option is not None:
        options[option] = sampling_dtype(cfg, model, compute_dtype)
    return build_engine(cfg.rollout.engine, model, tokenizer, **options)


def sampling_dtype(cfg: Config, model: torch.nn.Module, compute_dtype: torch.dtype) -> torch.dtype | str | None:
    """The dtype an engine with a `compute_dtype_option` samples `model` in: that option if rollout.engine_options
    sets it, else `compute_dtype` (the run's, resolved once in RunFacts; such an engine's copy lives on the training
    device) where it differs from the parameters' (None: the parameters' own)."""
    option = cfg.rollout.engine_type.compute_dtype_option
    if option in cfg.rollout.engine_options:
        return cfg.rollout.engine_options[option]
    return compute_dtype if compute_dtype != next(model.parameters()).dtype else None


def reward_manager(cfg: Config, task: Task) -> RewardManager:
    return build_reward_manager(cfg.rewards or list(task.default_rewards), task, cfg.reward_on_error,
                                cfg.reward_timeout, max_faulty_calls=cfg.reward_max_faulty_calls)


def verifier(rewards: RewardManager, task: Task) -> Verify:
    """The run's correctness check: the `correct` reward alone, so other (possibly faulty or costly) rewards play
    no part in it; without a `correct` reward nothing counts as correct."""
    specs = [s for s in rewards.specs if s.name == "correct"]
    manager = RewardManager(specs, task, rewards.on_error, rewards.timeout_s) if specs else None

    def verify(problems: list[Problem], group_index: torch.Tensor, completions: list[str],
               environments: list | None = None) -> torch.Tensor:
        if manager is None:
            return torch.zeros(len(completions), dtype=torch.bool)
        return manager.score(problems, group_index, completions, environments=environments).correct

    return verify
