"""GRPO (docs/methods.md#grpo): rollout.n rollouts per prompt, all trained with group-normalised advantages. The
protocol's defaults are exactly this, so the method is the base class under its name."""

from __future__ import annotations

from podsrl.methods.base import Method


class GRPO(Method):
    name = "grpo"
