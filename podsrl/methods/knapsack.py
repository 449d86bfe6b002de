"""Knapsack-RL (docs/methods.md#knapsack-rl): the step's rollout budget B = P · rollout.n split over prompts as a
knapsack.

collect: each prompt's success rate p̂ comes from PromptStats (the last visit if it had >= `window` rollouts, else
the newest `window` outcomes); prompts with fewer than `min_history` rollouts so far get rollout.n; the rest is
`knapsack_allocation` (greedy on marginal value, exact). select: every rollout trains with the GRPO advantage over
its whole variable-size group (the default), plus the reference's effectiveness metrics. The reference clips
advantages to ±5 in both arms: `algo.advantage_clip: 5` in the preset and its GRPO baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

from podsrl.algo.group_stats import group_outcomes, zero_variance_groups
from podsrl.algo.knapsack import knapsack_allocation, success_rate
from podsrl.batch import Problem, RolloutBatch
from podsrl.errors import ConfigError
from podsrl.methods.base import ConfigView, Method, StepContext
from podsrl.options import option
from podsrl.prompt_stats import RING


@dataclass
class KnapsackConfig:
    min_n: int = option(2, "Rollouts of a prompt with 0 < p < 1 before the solver adds more.")
    max_n: int = option(128, "Most rollouts one prompt gets.")
    negative_n: int = option(2, "Rollouts of a prompt that has never been solved lately (p = 0).")
    positive_n: int = option(2, "Rollouts of a prompt that is always solved lately (p = 1).")
    alpha: float = option(0.9, "Fallback: an effective prompt needs ln(1-alpha)/ln(max(p, 1-p)) rollouts; if all of "
                          "them need less than the budget, the surplus goes to p = 0 prompts.")
    min_history: int = option(8, "Rollouts seen before a prompt's rate is trusted; until then it gets rollout.n.")
    window: int = option(16, "p is the last visit's success rate if it had >= window rollouts, else the mean of the "
                         "newest window outcomes (at most 16, the per-prompt ring).")
    ref_quirks: bool = option(False, "Reproduce the reference: prompts without history count as p = 0 in the fallback, "
                              "and budget beyond max_n stays on the effective prompts.")


class Knapsack(Method):
    name = "knapsack"
    section = KnapsackConfig

    @classmethod
    def validate(cls, cfg: ConfigView) -> None:
        k, n = cfg.knapsack, cfg.rollout.n
        for key in ("min_n", "negative_n", "positive_n"):
            value = getattr(k, key)
            if not 1 <= value <= n:
                raise ConfigError(f"knapsack.{key}: must be in [1, rollout.n={n}], got {value}")
        if k.max_n < n:
            raise ConfigError(f"knapsack.max_n ({k.max_n}) must be >= rollout.n ({n}): the budget P * rollout.n "
                              "must fit under the per-prompt cap")
        if not 0 < k.alpha < 1:
            raise ConfigError(f"knapsack.alpha: must be in (0, 1), got {k.alpha}")
        if not 1 <= k.window <= RING:
            raise ConfigError(f"knapsack.window: must be in [1, {RING}] (the per-prompt ring), got {k.window}")
        if k.min_history < 0:
            raise ConfigError(f"knapsack.min_history: must be >= 0, got {k.min_history}")

    def allocate(self, problems: list[Problem], ctx: StepContext) -> tuple[list[int], dict]:
        """Rollouts per prompt (Σ = P · rollout.n) and the allocation metrics."""
        k, n = self.cfg.knapsack, self.cfg.rollout.n
        uids = [p.uid for p in problems]
        _, attempts = ctx.stats.counts(uids)
        last_s, last_n = ctx.stats.last_visit(uids)
        rates = [success_rate(int(s), int(a), ctx.stats.recent(u), k.window)
                 for u, s, a in zip(uids, last_s.tolist(), last_n.tolist())]
        valid = (attempts >= k.min_history).tolist()
        out = knapsack_allocation(rates, valid, n, n * len(problems), min_n=k.min_n, max_n=k.max_n,
                                  negative_n=k.negative_n, positive_n=k.positive_n, alpha=k.alpha,
                                  ref_quirks=k.ref_quirks)
        metrics = {
            "allocation/budget_fallback": float(out.fallback),
            "allocation/fallback_effective_ratio": out.fallback_effective_ratio,
            "allocation/max_budget": float(max(out.counts)),
            "allocation/min_budget": float(min(out.counts)),
            "allocation/covered_prompts": float(sum(c > 0 for c in out.counts)),
            "allocation/leftover": float(out.leftover),
        }
        return out.counts, metrics

    def collect(self, problems: list[Problem], ctx: StepContext) -> tuple[RolloutBatch, dict]:
        counts, metrics = self.allocate(problems, ctx)
        return ctx.generate(problems, list(range(len(problems))), counts), metrics

    def select(self, batch: RolloutBatch, ctx: StepContext) -> tuple[RolloutBatch, dict]:
        metrics = effectiveness_metrics(batch)
        kept, more = super().select(batch, ctx)
        return kept, {**metrics, **more}


def effectiveness_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The reference's share of rollouts in groups whose rewards differ (a non-zero gradient), the share of such
    prompts, and the prompts' difficulty histogram by group success rate: 1, [0.8, 1), (0.2, 0.8), (0, 0.2], 0."""
    g = batch.group_index
    attempts, successes = group_outcomes(g, batch.correct, batch.num_groups)
    present = attempts > 0
    rate = successes.double() / attempts.clamp(min=1)
    mixed = ~zero_variance_groups(batch.rewards, g, batch.num_groups)
    prompts = max(int(present.sum()), 1)
    bins = {
        "extremely_easy": rate == 1, "easy": (rate >= 0.8) & (rate < 1), "medium": (rate > 0.2) & (rate < 0.8),
        "hard": (rate > 0) & (rate <= 0.2), "extremely_hard": rate == 0,
    }
    metrics = {f"prompt/{name}_ratio": float((mask & present).sum()) / prompts for name, mask in bins.items()}
    metrics["training/effective_prompt_ratio"] = float(mixed.sum()) / prompts
    metrics["training/effective_gradient_ratio"] = float(attempts[mixed].sum()) / max(batch.num_rollouts, 1)
    return metrics
