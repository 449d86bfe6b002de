"""Reinforce-Ada (docs/methods.md#reinforce-ada): sample in rounds until each prompt's pool has signal, then train
on a balanced group of rollout.n with the pool mean as baseline.

collect: round r draws `round_repeat` rollouts for every active prompt; after the round, prompts whose pool passes
the exit test stop; at most `max_rounds` rounds. The returned batch is the whole pool (every round, so the loop
counts every generated rollout and PromptStats sees them all). select: each prompt keeps rollout.n rows of its pool
(`balanced_keep`: earliest positives and negatives in generation order), advantage r − mean(pool). Unresolved
prompts stay in the batch (zero advantage if their pool is constant); `filter.zero_variance` drops those.

Whether a prompt exited needs no state: pools only grow and a prompt stops at the first round its pool passes the
test, so it exited iff its final pool passes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from podsrl.algo.group_stats import group_outcomes
from podsrl.algo.reinforce_ada import balanced_keep, exit_test, pool_advantages
from podsrl.algo.selection import selection_metrics
from podsrl.batch import Problem, RolloutBatch, concat_batches
from podsrl.errors import ConfigError
from podsrl.methods.base import ConfigView, Method, StepContext
from podsrl.options import option


@dataclass
class ReinforceAdaConfig:
    round_repeat: int = option(8, "Rollouts drawn per active prompt in each round (M).")
    max_rounds: int = option(4, "Most sampling rounds per step (R).")
    positive_threshold: float = option(0.7, "A rollout is positive iff its reward exceeds this.")
    exit_rule: Literal["balanced", "positive_focused"] = option(
        "balanced", "A prompt stops sampling once its pool has floor(n/2) positives and n - floor(n/2) negatives "
        "(balanced), or one positive (positive_focused).")
    std: bool = option(False, "Divide the advantage r - mean(pool) by the pool's std (off in the reference script).")
    epsilon: float = option(1e-6, "Floor of the pool std and its additive epsilon when std is on.")


class ReinforceAda(Method):
    name = "reinforce_ada"
    section = ReinforceAdaConfig

    @classmethod
    def validate(cls, cfg: ConfigView) -> None:
        r = cfg.reinforce_ada
        if r.round_repeat < 1:
            raise ConfigError(f"reinforce_ada.round_repeat: must be >= 1, got {r.round_repeat}")
        if r.max_rounds < 1:
            raise ConfigError(f"reinforce_ada.max_rounds: must be >= 1, got {r.max_rounds}")
        if r.epsilon <= 0:
            raise ConfigError(f"reinforce_ada.epsilon: must be > 0, got {r.epsilon}")

    def _pool_counts(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """([P] positives, [P] negatives) of the pool so far."""
        positive = batch.rewards > self.cfg.reinforce_ada.positive_threshold
        attempts, pos = group_outcomes(batch.group_index, positive, batch.num_groups)
        return pos, attempts - pos

    def collect(self, problems: list[Problem], ctx: StepContext) -> tuple[RolloutBatch, dict]:
        r, n = self.cfg.reinforce_ada, self.cfg.rollout.n
        active = list(range(len(problems)))
        rounds: list[RolloutBatch] = []
        finished_first = 0
        while active and len(rounds) < r.max_rounds:
            rounds.append(ctx.generate(problems, active, [r.round_repeat] * len(active)))
            pool = rounds[0] if len(rounds) == 1 else concat_batches(rounds, ctx.pad_token_id)
            done = exit_test(*self._pool_counts(pool), n, r.exit_rule)
            if len(rounds) == 1:
                finished_first = int(done.sum())
            active = [i for i in active if not bool(done[i])]
        metrics = {
            "sampling/total_samples": float(pool.num_rollouts),
            "sampling/total_prompts": float(len(problems)),
            "sampling/prompts_active_only_1st_round": float(finished_first),
            "sampling/prompts_unfinished": float(len(active)),
            "sampling/rounds": float(len(rounds)),
            "critic/real_reward": float(rounds[0].rewards.mean()),
        }
        return pool, metrics

    def select(self, batch: RolloutBatch, ctx: StepContext) -> tuple[RolloutBatch, dict]:
        r, n = self.cfg.reinforce_ada, self.cfg.rollout.n
        pos, neg = self._pool_counts(batch)
        resolved = exit_test(pos, neg, n, r.exit_rule)
        rows = balanced_keep(batch.rewards > r.positive_threshold, batch.group_index, batch.num_groups, resolved, n,
                             r.exit_rule)
        kept = batch.select_rows(rows)
        kept.advantages = pool_advantages(kept.rewards, kept.group_index, batch.rewards, batch.group_index,
                                          batch.num_groups, std=r.std, epsilon=r.epsilon)
        metrics = selection_metrics(batch.rewards, batch.group_index, batch.num_groups, rows)
        return kept, {**metrics, "sampling/kept_samples": float(kept.num_rollouts)}
