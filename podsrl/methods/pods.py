"""PODS (docs/methods.md#pods): generate rollout.n per prompt, train on the pods.m chosen by a rule (max-variance by
default), with GRPO advantages over the kept subset or the whole group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from podsrl.algo.selection import select_rollouts, selection_metrics
from podsrl.batch import RolloutBatch
from podsrl.errors import ConfigError
from podsrl.methods.base import Method, StepContext
from podsrl.options import option

if TYPE_CHECKING:
    from podsrl.config import Config


@dataclass
class PodsConfig:
    m: int = option(0, "Rollouts trained per prompt, chosen from the rollout.n generated; 0 means m = n (no "
                    "down-sampling).")
    rule: Literal["max_variance", "max_reward", "random"] = option(
        "max_variance", "Down-sampling rule when m < n: the m-subset of largest reward variance (the paper's), the "
        "m largest rewards, or a uniform m-subset.")
    normalize_over: Literal["subset", "group"] = option("subset", "Advantage statistics over the kept subset or group.")


class PODS(Method):
    name = "pods"
    section = PodsConfig

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.m = self.trained_per_prompt(cfg)

    @classmethod
    def trained_per_prompt(cls, cfg: Config) -> int:
        return cfg.pods.m or cfg.rollout.n  # 0 = all n

    @classmethod
    def validate(cls, cfg: Config) -> None:
        m, n = cfg.pods.m, cfg.rollout.n
        if not 0 <= m <= n:
            raise ConfigError(f"pods.m: must be in [0, rollout.n={n}] (0 = n), got {m}")
        if m == 1:
            raise ConfigError("pods.m: 1 rollout per prompt has no group to compare with (every advantage would be "
                              "0); use pods.m >= 2")

    def select(self, batch: RolloutBatch, ctx: StepContext) -> tuple[RolloutBatch, dict[str, float]]:
        p = self.cfg.pods
        rule = p.rule if self.m < self.cfg.rollout.n else "none"
        rows = select_rollouts(batch.rewards, batch.group_index, batch.num_groups, self.m, rule, ctx.rng)
        kept = batch.select_rows(rows)
        kept.advantages = self.grpo_advantages(kept, batch if p.normalize_over == "group" else None)
        return kept, selection_metrics(batch.rewards, batch.group_index, batch.num_groups, rows)
