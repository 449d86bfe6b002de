"""Rollout-efficiency methods, one module each, chosen by the top-level `method` key. Adding a method: a module
with a `Method` subclass (podsrl/methods/base.py) and its config section dataclass (`section`), and one line here;
podsrl/config/sections.py composes the sections from this registry (docs/architecture.md has a complete example)."""

from podsrl.methods.aero import AERO
from podsrl.methods.base import Method, StepContext, offline_context
from podsrl.methods.dynamo import DynaMO
from podsrl.methods.greso import Greso
from podsrl.methods.grpo import GRPO
from podsrl.methods.knapsack import Knapsack
from podsrl.methods.pods import PODS
from podsrl.methods.reinforce_ada import ReinforceAda

METHODS: dict[str, type[Method]] = {
    "grpo": GRPO,
    "pods": PODS,
    "aero": AERO,
    "dynamo": DynaMO,
    "greso": Greso,
    "knapsack": Knapsack,
    "reinforce_ada": ReinforceAda,
}

__all__ = ["METHODS", "Method", "StepContext", "offline_context"]
