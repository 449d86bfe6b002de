"""Rollout engines: where completions are sampled. All sit behind `RolloutEngine` (see base.py)."""

from podsrl.engines.base import GenerationOutput, RolloutEngine, SamplingParams, build_engine

__all__ = ["GenerationOutput", "RolloutEngine", "SamplingParams", "build_engine"]
