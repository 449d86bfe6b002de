"""Optional dependencies: a missing one is a one-line error at start-up naming the extra that installs it.

Without this, a missing package surfaces late and in disguise (e.g. every math-verify worker dying and the reward
policy turning each failure into a zero reward), so every feature that needs an extra asks here first.
"""

from __future__ import annotations

import importlib.util
import sys

from podsrl.errors import UserError

# import name -> (pip distribution, podsrl extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "math_verify": ("math-verify", "tasks"),
    "datasets": ("datasets", "tasks"),
    "pyarrow": ("pyarrow", "tasks"),
    "reasoning_gym": ("reasoning-gym", "reasoning-gym"),
    "peft": ("peft", "tasks"),
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}
# why an extra is not part of `tasks`/`all`, said where it is missing
BUILDS_FROM_SOURCE = {
    "reasoning_gym": "reasoning-gym has an extra of its own because its dependency pycosat publishes no Linux "
                     "wheel and is compiled at install (a C compiler is needed)",
}


def require(module: str, needed_for: str) -> None:
    """Raise UserError unless `module` can be imported (checked without importing it, so it stays cheap)."""
    if sys.modules.get(module, False) is not None and (module in sys.modules or importlib.util.find_spec(module)):
        return
    dist, extra = EXTRAS[module]
    why = f"; {BUILDS_FROM_SOURCE[module]}" if module in BUILDS_FROM_SOURCE else ""
    raise UserError(f"{needed_for} needs the optional package {dist!r}, which is not installed: "
                    f"pip install 'podsrl[{extra}]' (or pip install {dist}){why}")
