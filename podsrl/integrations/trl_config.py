"""`PODSGRPOConfig`: TRL's `GRPOConfig` plus the PODS down-sampling and zero-variance filtering knobs.

Batch-size semantics stay TRL's: `per_device_train_batch_size × steps_per_generation` completions are *generated* per
device per generation (n = `num_generations` per prompt). After selection each prompt keeps `pods_m` of them, so every
micro-step's loss sees `per_device_train_batch_size · pods_m / num_generations` completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from podsrl.errors import ConfigError

TRL_SUPPORTED = (">=1.0", "<2")
TRL_SUPPORTED_SPEC = "trl" + ",".join(TRL_SUPPORTED)


def require_trl() -> str:
    """Return the installed TRL version; ImportError naming the supported range if it is missing or outside it."""
    try:
        import trl
    except ImportError:
        raise ImportError(
            f"podsrl.integrations.trl needs TRL ({TRL_SUPPORTED_SPEC}); install it with "
            f"`pip install 'podsrl[trl]'` or `pip install '{TRL_SUPPORTED_SPEC}'`."
        ) from None
    from packaging.version import InvalidVersion, Version

    found = getattr(trl, "__version__", "unknown")
    try:
        major = Version(found).major
    except InvalidVersion:
        major = -1
    if major != 1:
        raise ImportError(
            f"podsrl.integrations.trl supports {TRL_SUPPORTED_SPEC} (it relies on GRPOTrainer internals of that "
            f"line); found trl {found}. Install a supported version: `pip install '{TRL_SUPPORTED_SPEC}'`."
        )
    return found


require_trl()

# Only after the version check, so an unsupported TRL fails with the message above.
from trl import GRPOConfig  # noqa: E402

PODS_RULES = ("max_variance", "max_reward", "random", "none")
NORMALIZE_OVER = ("subset", "group")


class PODSConfigError(ConfigError, ValueError):
    """A PODS setting is wrong or inconsistent with TRL's batch settings (a ValueError, as TRL's own checks)."""


@dataclass
class PODSGRPOConfig(GRPOConfig):
    """GRPOConfig with PODS: generate `num_generations` (n) completions per prompt, train on `pods_m` of them."""

    pods_m: int | None = field(
        default=None,
        metadata={
            "help": "Completions kept per prompt for the update (m); `num_generations` is n, the number generated. "
            "`None` keeps all n (plain GRPO). Each micro-step then trains on per_device_train_batch_size * m / n "
            "completions, so per_device_train_batch_size * m must be divisible by num_generations."
        },
    )
    pods_rule: str = field(
        default="max_variance",
        metadata={
            "help": "Which m of the n completions to keep: 'max_variance' (the m-subset with the largest reward "
            "variance, the PODS rule), 'max_reward' (top m), 'random' (uniform m-subset) or 'none' (keep all; "
            "requires pods_m = num_generations)."
        },
    )
    pods_normalize_over: str = field(
        default="subset",
        metadata={
            "help": "Statistics of the advantages after selection: 'subset' (mean/std of the kept m, as the PODS "
            "reference) or 'group' (mean/std of all n generated). `scale_rewards` still picks group/batch/none."
        },
    )
    filter_zero_variance: bool = field(
        default=False,
        metadata={
            "help": "Drop prompts whose rewards all agree (over the kept subset, or over the whole group with "
            "pods_normalize_over='group'): they carry no advantage signal. No refill: when too few completions "
            "survive to fill every micro-step, the fewest dropped ones are kept back with advantage 0 "
            "(logged as pods/completions_padded)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_generations
        if self.pods_m is None:
            self.pods_m = n
        if isinstance(self.pods_m, bool) or not isinstance(self.pods_m, int):
            raise PODSConfigError(f"pods_m must be an integer, got {self.pods_m!r}")
        if self.pods_rule not in PODS_RULES:
            raise PODSConfigError(f"pods_rule must be one of {', '.join(PODS_RULES)}; got {self.pods_rule!r}")
        if self.pods_normalize_over not in NORMALIZE_OVER:
            raise PODSConfigError(
                f"pods_normalize_over must be one of {', '.join(NORMALIZE_OVER)}; got {self.pods_normalize_over!r}"
            )
        if not 1 <= self.pods_m <= n:
            raise PODSConfigError(f"pods_m must lie in [1, num_generations={n}]; got {self.pods_m}")
        if self.pods_rule == "none" and self.pods_m != n:
            raise PODSConfigError(
                f"pods_rule='none' keeps every completion, so pods_m must equal num_generations ({n}); got "
                f"pods_m={self.pods_m}. Pick a selection rule or set pods_m={n}."
            )
        if self.pods_m == 1 and self.pods_normalize_over == "subset":
            raise PODSConfigError(
                "pods_m=1 with pods_normalize_over='subset' gives every completion advantage 0; use pods_m >= 2 "
                "or pods_normalize_over='group'."
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise PODSConfigError(
                "PODS selects on the weighted sum of the rewards, so multi_objective_aggregation must be "
                f"'sum_then_normalize'; got {self.multi_objective_aggregation!r}."
            )
        per_device_generated = self.per_device_train_batch_size * self.steps_per_generation
        if per_device_generated % n != 0:
            raise PODSConfigError(
                f"per_device_train_batch_size * steps_per_generation ({per_device_generated}) completions are "
                f"generated per device; it must be divisible by num_generations ({n}) so that every device holds "
                "whole prompt groups to select from."
            )
        if (self.per_device_train_batch_size * self.pods_m) % n != 0:
            raise PODSConfigError(
                f"per_device_train_batch_size * pods_m ({self.per_device_train_batch_size} * {self.pods_m}) must be "
                f"divisible by num_generations ({n}): each micro-step trains on "
                "per_device_train_batch_size * pods_m / num_generations completions."
            )

    @property
    def pods_train_micro_batch_size(self) -> int:
        """Completions per device that reach one micro-step's loss (before any zero-variance filtering)."""
        return self.per_device_train_batch_size * self.pods_m // self.num_generations
