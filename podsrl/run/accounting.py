"""Compute accounting shared by every method, so that all methods compare on the same ledger.

FLOPs are the usual dense-transformer estimates (docs/methods.md#cost-accounting): ≈2·params per generated token
(one forward) and ≈6·params per trained token per update pass (forward + backward). They ignore attention's
quadratic term, the prompt tokens, and the extra forward passes for old / reference log-probs: an estimate to
compare methods run on the same model, not a profiler reading.

Generated tokens are the model's alone (TRL's count); an episode's environment tokens (tool answers, environment
messages), prefilled like a prompt's, are counted apart as `tokens/environment`.
"""

from __future__ import annotations

_COUNTERS = (
    "rollouts_generated",
    "rollouts_trained",
    "tokens_generated",
    "tokens_environment",
    "tokens_trained",
    "flops_generate_est",
    "flops_update_est",
)


class ComputeAccountant:
    """Per-step and cumulative counts of rollouts, tokens and estimated FLOPs; checkpointed as plain JSON."""

    def __init__(self, params: int) -> None:
        if int(params) < 0:
            raise ValueError(f"params must be >= 0, got {params}")
        self.params = int(params)
        self.steps = 0
        self.totals: dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    def step(
        self,
        generated_rollouts: int,
        generated_tokens: int,
        trained_rollouts: int,
        trained_tokens: int,
        passes: int = 1,
        environment_tokens: int = 0,
    ) -> dict[str, float]:
        """Record one training step and return its metrics plus the running totals.

        `passes` is μ, the number of update passes over the trained batch (each one costs a forward + backward).
        Counts may be ints or 0-d tensors.
        """
        counts = {
            "generated_rollouts": int(generated_rollouts),
            "generated_tokens": int(generated_tokens),
            "trained_rollouts": int(trained_rollouts),
            "trained_tokens": int(trained_tokens),
            "passes": int(passes),
            "environment_tokens": int(environment_tokens),
        }
        for name, value in counts.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        flops_gen = 2 * self.params * counts["generated_tokens"]
        flops_upd = 6 * self.params * counts["trained_tokens"] * counts["passes"]
        step_values = {
            "rollouts_generated": counts["generated_rollouts"],
            "rollouts_trained": counts["trained_rollouts"],
            "tokens_generated": counts["generated_tokens"],
            "tokens_environment": counts["environment_tokens"],
            "tokens_trained": counts["trained_tokens"],
            "flops_generate_est": flops_gen,
            "flops_update_est": flops_upd,
        }
        for key, value in step_values.items():
            self.totals[key] += value  # Python ints: exact however long the run
        self.steps += 1
        return {
            "rollouts/generated": float(counts["generated_rollouts"]),
            "rollouts/trained": float(counts["trained_rollouts"]),
            "tokens/generated": float(counts["generated_tokens"]),
            "tokens/environment": float(counts["environment_tokens"]),
            "tokens/trained": float(counts["trained_tokens"]),
            "flops/generate_est": float(flops_gen),
            "flops/update_est": float(flops_upd),
            "flops/total_est": float(flops_gen + flops_upd),
            **self.total_metrics(),
        }

    def total_metrics(self) -> dict[str, float]:
        """The cumulative "total/..." metrics alone (eval records carry them too)."""
        out = {f"total/{key}": float(value) for key, value in self.totals.items()}
        out["total/flops_est"] = float(self.totals["flops_generate_est"] + self.totals["flops_update_est"])
        return out

    def state_dict(self) -> dict:
        return {"params": self.params, "steps": self.steps, "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        totals = {"tokens_environment": 0, **state.get("totals", {})}  # older checkpoints: none counted apart
        missing = [key for key in _COUNTERS if key not in totals]
        if missing:
            raise ValueError(f"accounting state lacks totals {missing}")
        if int(state["params"]) != self.params:
            raise ValueError(
                f"accounting state was saved for a model of {state['params']} parameters, this one has {self.params}"
            )
        self.steps = int(state["steps"])
        self.totals = {key: int(totals[key]) for key in _COUNTERS}
