"""What the policy update reads of the run configuration, and nothing else: PolicyUpdater is handed these rather
than the whole config, so what can change an update is listed here."""

from __future__ import annotations

from dataclasses import dataclass

from podsrl.algo.rollout_correction import uncorrected_staleness
from podsrl.config import AlgoConfig, Config, OptimConfig, UpdateConfig


@dataclass(frozen=True)
class UpdateSettings:
    optim: OptimConfig  # passes, mini-batches, the micro-batches' token budget, clipping (as loaded: 0 is auto)
    micro_batch_size: int  # rows per micro-batch on each rank: optim.micro_batch_size, auto decided at start-up
    update: UpdateConfig  # the forward's path: shared prompts, logits chunks, activation checkpointing
    algo: AlgoConfig  # the loss: clip range, KL, loss aggregation, rollout correction
    temperature: float  # rollout.temperature: log-probs are of the temperature-scaled policy
    max_new_tokens: int  # rollout.max_new_tokens: the length the loss aggregations normalise by
    grad_noise: bool  # log.grad_noise: probe the gradient noise on the first mini-batch of a step
    lora: bool  # model.lora_rank > 0: adapters over a frozen base (the precision log line says so)
    unchecked_staleness: str | None  # the warning for stale batches trained unchecked (train.async), or None

    @classmethod
    def of(cls, cfg: Config, micro_batch_size: int | None = None) -> UpdateSettings:
        """`micro_batch_size`: the size a run decided for optim.micro_batch_size=auto
        (podsrl/run/micro_batch.py resolve_micro_batch); None takes the config's."""
        size = cfg.optim.micro_batch_size if micro_batch_size is None else micro_batch_size
        return cls(optim=cfg.optim, micro_batch_size=size, update=cfg.update, algo=cfg.algo,
                   temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                   grad_noise=cfg.log.grad_noise, lora=cfg.model.lora_rank > 0,
                   unchecked_staleness=uncorrected_staleness(cfg))
