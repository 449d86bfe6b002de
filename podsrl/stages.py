"""Method-specific stages of a step, chosen by config: how many rollouts each prompt gets, and which rollouts are
trained with which advantages. The trainer calls these and stays algorithm-blind.

- allocation: `uniform` (n each: GRPO, PODS) or `variance` (DynaMO: n_i proportional to success-rate variance).
- selection: a PODS rule (`max_variance`, `max_reward`, `random`, `none`) with GRPO advantages over the kept subset,
  or `aero` (selective rejection + Beta-posterior advantages for all-same groups).
"""

from __future__ import annotations

import torch

from podsrl.algo.advantages import grpo_advantages
from podsrl.batch import RolloutBatch
from podsrl.config import Config
from podsrl.select.aero import aero_advantages, aero_select
from podsrl.select.allocation import allocate_by_variance, allocation_metrics
from podsrl.select.downsample import select_rollouts, selection_metrics
from podsrl.select.prompt_stats import PromptStats


def rollout_counts(cfg: Config, stats: PromptStats, uids: list[str]) -> tuple[list[int], dict]:
    """Rollouts per prompt for this step (budget P * rollout.n in both cases)."""
    n = cfg.rollout.n
    if cfg.rollout.allocation == "uniform":
        return [n] * len(uids), {}
    d = cfg.dynamo
    successes, attempts = stats.counts(uids)
    counts = allocate_by_variance(
        successes, attempts, budget=n * len(uids), n_min=d.n_min, n_max=d.n_max, explore=d.explore or n,
        min_history=d.min_history, mastered_rate=d.mastered_rate, floor=d.floor, weight=d.weight,
    )
    metrics = allocation_metrics(counts, successes, attempts, min_history=d.min_history,
                                 mastered_rate=d.mastered_rate)
    return counts.tolist(), metrics


def select_for_update(cfg: Config, batch: RolloutBatch, stats: PromptStats,
                      generator: torch.Generator) -> tuple[RolloutBatch, dict]:
    """The rollouts that enter the update, with their advantages. `stats` already holds this step's outcomes."""
    if cfg.select.rule == "aero":
        a = cfg.aero
        posterior = stats.posterior_mean([p.uid for p in batch.problems], a.alpha0, a.beta0)
        kept_rows, dead, metrics = aero_select(batch, posterior, k=a.k, symmetric=a.symmetric,
                                               keep_dead=a.keep_dead, generator=generator,
                                               mode=a.dead_zone_advantage, epsilon=cfg.algo.advantage_epsilon)
        kept = batch.select_rows(kept_rows)
        kept.advantages = aero_advantages(kept.rewards, kept.correct, kept.group_index, kept.num_groups, dead,
                                          posterior, mode=a.dead_zone_advantage,
                                          epsilon=cfg.algo.advantage_epsilon).float()
        metrics.update(selection_metrics(batch.rewards, batch.group_index, batch.num_groups, kept_rows))
        return kept, metrics
    rule = cfg.select.rule if cfg.m < cfg.rollout.n else "none"
    kept_rows = select_rollouts(batch.rewards, batch.group_index, batch.num_groups, cfg.m, rule, generator)
    metrics = selection_metrics(batch.rewards, batch.group_index, batch.num_groups, kept_rows)
    kept = batch.select_rows(kept_rows)
    stats_source = (batch.rewards, batch.group_index) if cfg.select.normalize_over == "group" else (None, None)
    kept.advantages = grpo_advantages(kept.rewards, kept.group_index, kept.num_groups, cfg.algo.scale,
                                      cfg.algo.advantage_epsilon, *stats_source)
    return kept, metrics
