"""Running programs a model wrote, isolated from the run (docs/episodes.md, "The sandbox")."""

from podsrl.sandbox.box import Completed, Sandbox, SandboxLimits

__all__ = ["Completed", "Sandbox", "SandboxLimits"]
