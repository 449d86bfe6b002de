"""PODS (docs/methods.md#pods): generate rollout.n per prompt, train on the pods.m chosen by a rule (max-variance by
default), with GRPO advantages over the kept subset or the whole group. Over episodes, pods.stop_decided_groups stops
a group's live episodes between turns once its finished ones hold the max-variance subset (docs/episodes.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from podsrl.algo.selection import max_variance_decided, pods_keep, selection_metrics
from podsrl.batch import RolloutBatch
from podsrl.errors import ConfigError
from podsrl.methods.base import ConfigView, EpisodeStopRule, Method, StepContext
from podsrl.options import option


@dataclass
class PodsConfig:
    m: int = option(0, "Rollouts trained per prompt, chosen from the rollout.n generated; 0 means m = n (no "
                    "down-sampling).")
    rule: Literal["max_variance", "max_reward", "random"] = option(
        "max_variance", "Down-sampling rule when m < n: the m-subset of largest reward variance (the paper's), the "
        "m largest rewards, or a uniform m-subset.")
    normalize_over: Literal["subset", "group"] = option("subset", "Advantage statistics over the kept subset or group.")
    stop_decided_groups: bool = option(
        False, "Episode tasks: stop a group's live episodes before their next turn once its finished episodes hold "
        "the max-variance m-subset (m/2 correct, m/2 wrong), and select from the finished ones. Needs "
        "rule=max_variance, m < rollout.n and the `correct` reward alone (rewards in [0, 1]).")


class PODS(Method):
    name = "pods"
    section = PodsConfig

    def __init__(self, cfg: ConfigView) -> None:
        super().__init__(cfg)
        self.m = self.trained_per_prompt(cfg)

    @classmethod
    def trained_per_prompt(cls, cfg: ConfigView) -> int:
        return cfg.pods.m or cfg.rollout.n  # 0 = all n

    @classmethod
    def validate(cls, cfg: ConfigView) -> None:
        m, n = cfg.pods.m, cfg.rollout.n
        if not 0 <= m <= n:
            raise ConfigError(f"pods.m: must be in [0, rollout.n={n}] (0 = n), got {m}")
        if m == 1:
            raise ConfigError("pods.m: 1 rollout per prompt has no group to compare with (every advantage would be "
                              "0); use pods.m >= 2")
        if cfg.pods.stop_decided_groups:
            cls._validate_stop(cfg)

    @staticmethod
    def _validate_stop(cfg: ConfigView) -> None:
        """The stopping rule is exact for the max-variance rule over rewards in [0, 1] (the `correct` reward)."""
        p, n = cfg.pods, cfg.rollout.n
        if p.rule != "max_variance" or not 0 < p.m < n:
            raise ConfigError(f"pods.stop_decided_groups: needs pods.rule=max_variance and 0 < pods.m < rollout.n "
                              f"(got rule={p.rule}, m={p.m}, n={n})")
        if cfg.rewards not in ([], ["correct"], [{"name": "correct"}], [{"name": "correct", "weight": 1.0}]):
            raise ConfigError(f"pods.stop_decided_groups: needs the `correct` reward alone at weight 1 (rewards in "
                              f"[0, 1]), got rewards={cfg.rewards}")

    def episode_stop_rule(self) -> EpisodeStopRule | None:
        if not self.cfg.pods.stop_decided_groups:
            return None
        return lambda finished, live: max_variance_decided(finished, self.m)

    def select(self, batch: RolloutBatch, ctx: StepContext) -> tuple[RolloutBatch, dict[str, float]]:
        p, a = self.cfg.pods, self.cfg.algo
        rows, advantages = pods_keep(batch.rewards, batch.group_index, batch.num_groups, self.cfg.rollout.n, self.m,
                                     p.rule, p.normalize_over, a.scale, a.advantage_epsilon, ctx.rng)
        kept = batch.select_rows(rows)
        kept.advantages = advantages
        return kept, selection_metrics(batch.rewards, batch.group_index, batch.num_groups, rows)
