"""The cross-field checks of a loaded config (value ranges, keys that need each other), each naming the offending
key; the checks against the registries (engine options, trackers, the method's own) are podsrl/config/method_checks.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from podsrl.config.method_checks import check_choices
from podsrl.engines import ENGINES, engine_class
from podsrl.errors import ConfigError
from podsrl.tasks import task_class

if TYPE_CHECKING:
    from podsrl.config import Config

def validate(cfg: Config) -> None:
    """Cross-field checks, each naming the offending key."""

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{key}: {msg}")

    need(cfg.rollout.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
    need(cfg.rollout.n >= 1, "rollout.n", "must be >= 1")
    need(cfg.rollout.temperature > 0, "rollout.temperature", "must be > 0")
    need(0 < cfg.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    need(cfg.rollout.top_k >= 0, "rollout.top_k", "must be >= 0")
    need(cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    need(cfg.episode.max_turns >= 1, "episode.max_turns", "must be >= 1")
    need(0 <= cfg.episode.turn_discount <= 1, "episode.turn_discount", "must be in [0, 1]")
    need(cfg.episode.max_tokens >= 1, "episode.max_tokens", "must be >= 1")
    need(cfg.episode.tool_timeout_s > 0, "episode.tool_timeout_s", "must be > 0")
    need(cfg.episode.env_timeout_s > 0, "episode.env_timeout_s", "must be > 0")
    need(cfg.episode.timeout_s > 0, "episode.timeout_s", "must be > 0")
    need(cfg.episode.max_hung_calls >= 1, "episode.max_hung_calls", "must be >= 1")
    need(cfg.episode.max_parallel_calls >= 1, "episode.max_parallel_calls", "must be >= 1")
    need(cfg.episode.max_response_chars >= 64, "episode.max_response_chars", "must be >= 64 (a cut answer keeps "
         "its cut mark)")
    need(cfg.filter.max_refill_rounds >= 0, "filter.max_refill_rounds", "must be >= 0")
    need(cfg.algo.advantage_clip >= 0, "algo.advantage_clip", "must be >= 0 (0 = off)")
    need(cfg.algo.epsilon_low >= 0 and cfg.algo.epsilon_high >= 0, "algo.epsilon_low", "clip ranges must be >= 0")
    need(cfg.algo.beta >= 0, "algo.beta", "must be >= 0")
    need(cfg.algo.advantage_epsilon > 0, "algo.advantage_epsilon", "must be > 0")
    need(cfg.algo.rollout_correction_cap > cfg.algo.rollout_correction_cap_low >= 0,
         "algo.rollout_correction_cap", "needs rollout_correction_cap > rollout_correction_cap_low >= 0")
    need(cfg.optim.lr > 0, "optim.lr", "must be > 0")
    need(len(cfg.optim.betas) == 2, "optim.betas", "needs two values")
    need(cfg.optim.epochs >= 1, "optim.epochs", "must be >= 1")
    need(cfg.optim.mini_batches >= 1, "optim.mini_batches", "must be >= 1")
    need(cfg.optim.micro_batch_size >= 0, "optim.micro_batch_size", "must be >= 1, or 0 (auto)")
    need(cfg.optim.micro_batch_tokens >= 0, "optim.micro_batch_tokens", "must be >= 0 (0 = rows only)")
    need(cfg.update.logits_chunk >= 1, "update.logits_chunk", "must be >= 1")
    need(cfg.optim.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    need(cfg.optim.max_grad_norm >= 0, "optim.max_grad_norm", "must be >= 0")
    need(cfg.train.max_steps >= 1, "train.max_steps", "must be >= 1")
    need(cfg.train.max_seconds >= 0, "train.max_seconds", "must be >= 0")
    need(cfg.train.warn_seconds >= 0, "train.warn_seconds", "must be >= 0")
    need(cfg.train.max_rollouts >= 0, "train.max_rollouts", "must be >= 0")
    need(cfg.train.eval_every >= 1, "train.eval_every", "must be >= 1")
    need(cfg.train.save_every >= 1, "train.save_every", "must be >= 1")
    need(cfg.train.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
    need(cfg.train.wait_timeout_s > 0, "train.wait_timeout_s", "must be > 0 (seconds)")
    run_ahead = cfg.train.asynchronous
    need(run_ahead.max_staleness >= 0, "train.async.max_staleness", "must be >= 0 (0 = synchronous)")
    need(run_ahead.generator_threads >= 0, "train.async.generator_threads", "must be >= 0 (0 = half of torch's)")
    engine = engine_class(cfg.rollout.engine)
    if run_ahead.enabled and not engine.may_run_async:
        able = " or ".join(name for name in ENGINES if engine_class(name).may_run_async)
        need(False, "train.async.enabled",
             f"needs rollout.engine {able} (got {cfg.rollout.engine}): {engine.no_async_reason}")
    need(cfg.train.health_steps >= 0, "train.health_steps", "must be >= 0 (0 = no health checks)")
    need(cfg.train.health_min_entropy >= 0, "train.health_min_entropy", "must be >= 0")
    need(cfg.train.health_max_kl > 0, "train.health_max_kl", "must be > 0")
    need(0 < cfg.train.health_max_clipped <= 1, "train.health_max_clipped", "must be in (0, 1]")
    need(cfg.task.eval_size >= 0, "task.eval_size", "must be >= 0")
    need(cfg.eval.size >= 0, "eval.size", "must be >= 0")
    need(cfg.eval.samples >= 0, "eval.samples", "must be >= 0")
    need(cfg.eval.batch_size >= 1, "eval.batch_size", "must be >= 1")
    need(cfg.warmup.steps >= 0, "warmup.steps", "must be >= 0")
    need(0 <= cfg.warmup.target_accuracy <= 1, "warmup.target_accuracy", "must be in [0, 1]")
    need(cfg.warmup.check_every >= 1, "warmup.check_every", "must be >= 1")
    need(cfg.warmup.validation_size >= 1, "warmup.validation_size", "must be >= 1")
    need(cfg.reward_timeout > 0, "reward_timeout", "must be > 0")
    need(cfg.model.lora_rank >= 0, "model.lora_rank", "must be >= 0")
    need(cfg.model.dtype != "float16", "model.dtype", "float16 is refused: podsrl has no loss scaling, so small "
         "float16 gradients would underflow to zero; use bfloat16 (the same memory) or float32")
    fsdp = cfg.train.strategy == "fsdp"
    need(fsdp or not cfg.train.cpu_offload, "train.cpu_offload", "needs train.strategy=fsdp")
    need(not (fsdp and cfg.log.grad_noise), "log.grad_noise", "is not available with train.strategy=fsdp (its "
         "split-half gradients would be sharded); set log.grad_noise=false or train.strategy=ddp")
    need(bool(cfg.output_dir), "output_dir", "must not be empty")
    t = cfg.model.tiny
    need(t.hidden_size % t.num_heads == 0, "model.tiny.hidden_size", "must be divisible by model.tiny.num_heads")
    need(t.num_heads % 2 == 0 or t.num_heads == 1, "model.tiny.num_heads", "must be even (or 1)")
    need(not (cfg.model.name_or_path == "tiny" and cfg.warmup.steps > 0
             and not task_class(cfg.task.name).gives_references()),
         "warmup.steps", f"the built-in model's warm-up needs reference completions, which a {cfg.task.name} task "
         "does not have: set warmup.steps=0, or give model.name_or_path")
    # bring-your-own data, rewards and logging
    need(0 <= cfg.task.eval_fraction < 1, "task.eval_fraction", "must be in [0, 1)")
    need(cfg.task.max_prompt_length >= 0, "task.max_prompt_length", "must be >= 0 (0 = the model's context)")
    need(cfg.reward_max_faulty_calls >= 1, "reward_max_faulty_calls", "must be >= 1")
    need(cfg.log.log_every >= 1, "log.log_every", "must be >= 1")
    need(cfg.log.log_every_seconds > 0, "log.log_every_seconds", "must be > 0")
    check_choices(cfg)
