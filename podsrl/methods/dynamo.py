"""DynaMO (docs/methods.md#dynamo): the step's budget P * rollout.n is allocated across prompts by their success-rate
variance (algo/allocation.py), and, with dynamo.modulation, token advantages are modulated by entropy in the update
(algo/modulation.py).

With `dynamo.refresh: epoch` the allocation reads a snapshot of the statistics taken when the epoch of the step's
first prompt began, and the snapshot travels in the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from podsrl.algo.allocation import allocate_by_variance, allocation_metrics
from podsrl.algo.modulation import dynamo_modulation
from podsrl.batch import RolloutBatch
from podsrl.errors import ConfigError, UserError
from podsrl.methods.base import ConfigView, Method, StepContext, TokenModulation
from podsrl.options import option
from podsrl.prompt_stats import PromptStats


@dataclass
class DynamoConfig:
    n_min: int = option(8, "Fewest rollouts a prompt gets under variance allocation.")
    n_max: int = option(24, "Most rollouts a prompt gets under variance allocation.")
    unknown_rule: Literal["reference", "rollout_n"] = option(
        "reference", "Base count of prompts with too little history: max(n_min, min_history) - attempts, at least "
        "n_min, with the rest of the budget going to known prompts by priority (the reference code); or "
        "`explore` rollouts each (rollout_n).")
    explore: int = option(0, "Rollouts for prompts with too little history under unknown_rule=rollout_n (0 = rollout.n).")
    weight: Literal["variance", "std"] = option("variance", "Priority by Bernoulli variance (reference) or its root.")
    min_history: int = option(4, "Rollouts seen before a prompt's variance is trusted.")
    mastered_rate: float = option(0.85, "Success rate at which a prompt counts as mastered (priority = floor).")
    floor: float = option(0.01, "Smallest priority.")
    refresh: Literal["step", "epoch"] = option(
        "step", "Recompute priorities every step, or once per dataset epoch (the epoch of the step's first prompt).")
    modulation: bool = option(True, "Token-level advantage modulation by entropy (the factors below); false leaves "
                              "the allocation alone. Refuses log.grad_noise (the probe's micro-batches would change it).")
    lambda_min: float = option(0.6, "Stabilisation floor of the modulation factor.")
    gamma: float = option(50.0, "Stabilisation sharpness.")
    tau: float = option(0.99, "Stabilisation threshold on the normalised entropy change.")
    mu_max: float = option(1.2, "Largest compensation factor for low-entropy positive-advantage tokens.")
    stabilize: bool = option(True, "Apply the stabilisation factor.")
    compensate: bool = option(True, "Apply the compensation factor.")


class DynaMO(Method):
    name = "dynamo"
    section = DynamoConfig

    def __init__(self, cfg: ConfigView) -> None:
        super().__init__(cfg)
        self._snapshot: PromptStats | None = None  # refresh=epoch: the statistics at the start of ...
        self._snapshot_epoch = -1  # ... this epoch

    @classmethod
    def validate(cls, cfg: ConfigView) -> None:
        d, n = cfg.dynamo, cfg.rollout.n

        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {msg}")

        need(1 <= d.n_min <= n <= d.n_max, "dynamo.n_min",
             f"need 1 <= dynamo.n_min <= rollout.n <= dynamo.n_max (got {d.n_min}, {n}, {d.n_max})")
        need(d.explore >= 0, "dynamo.explore", "must be >= 0 (0 = rollout.n)")
        need(d.min_history >= 1, "dynamo.min_history", "must be >= 1")
        need(0 < d.mastered_rate <= 1, "dynamo.mastered_rate", "must be in (0, 1]")
        need(0 <= d.lambda_min <= 1, "dynamo.lambda_min", "must be in [0, 1]")
        need(d.gamma >= 0, "dynamo.gamma", "must be >= 0")
        need(d.mu_max >= 1, "dynamo.mu_max", "must be >= 1")
        need(not (d.modulation and cfg.log.grad_noise), "log.grad_noise", "the split-half probe forms micro-batches "
             "inside its halves, which changes DynaMO's per-micro-batch modulation; set log.grad_noise=false or "
             "dynamo.modulation=false")

    def collect(self, problems, ctx: StepContext) -> tuple[RolloutBatch, dict[str, float]]:
        d, n = self.cfg.dynamo, self.cfg.rollout.n
        successes, attempts = self._allocation_stats(ctx).counts([p.uid for p in problems])
        counts = allocate_by_variance(
            successes, attempts, budget=n * len(problems), n_min=d.n_min, n_max=d.n_max, explore=d.explore or n,
            unknown_rule=d.unknown_rule, min_history=d.min_history, mastered_rate=d.mastered_rate, floor=d.floor,
            weight=d.weight)
        metrics = allocation_metrics(counts, successes, attempts, min_history=d.min_history,
                                     mastered_rate=d.mastered_rate)
        return ctx.generate(problems, list(range(len(problems))), counts.tolist()), metrics

    def _allocation_stats(self, ctx: StepContext) -> PromptStats:
        """Statistics the allocation reads: live (refresh=step) or a snapshot taken at each epoch start."""
        if self.cfg.dynamo.refresh == "step":
            return ctx.stats
        if not ctx.epoch_size:
            raise UserError("dynamo.refresh: 'epoch' needs a finite training set (a dataset task, or "
                            "task.args.train_size for the arithmetic task); use 'step' for this task")
        if self._snapshot is None or self._snapshot_epoch != ctx.epoch:
            self._snapshot, self._snapshot_epoch = ctx.stats.copy(), ctx.epoch
        return self._snapshot

    def token_modulation(self) -> TokenModulation | None:
        if not self.cfg.dynamo.modulation:
            return None
        d, a = self.cfg.dynamo, self.cfg.algo

        def modulate(advantages, log_ratio, logprobs, entropy, mask):
            return dynamo_modulation(advantages, log_ratio, logprobs, entropy, mask, a.epsilon_low, a.epsilon_high,
                                     lambda_min=d.lambda_min, gamma=d.gamma, tau=d.tau, mu_max=d.mu_max,
                                     stabilize=d.stabilize, compensate=d.compensate)

        return modulate

    def state_dict(self) -> dict:
        if self._snapshot is None:
            return {}
        return {"snapshot_epoch": self._snapshot_epoch, "snapshot": self._snapshot.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._snapshot, self._snapshot_epoch = None, -1
        if "snapshot" in state:
            self._snapshot, self._snapshot_epoch = PromptStats(), int(state["snapshot_epoch"])
            self._snapshot.load_state_dict(state["snapshot"])
