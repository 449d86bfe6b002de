"""The method protocol: what a rollout-efficiency method may decide, and what the loop hands it each step.

The loop (podsrl/run/trainer.py) looks a method up by name once, `method = METHODS[cfg.method](cfg)`, and per step runs

    collect -> stats.record -> select -> zero-variance filter/refill -> advantage clip -> end_step -> update

`Method` itself is plain GRPO: rollout.n rollouts per prompt, every rollout trained, GRPO advantages. A method
overrides only the hooks where it differs, reads only its own config section, and keeps anything it must carry
across a resume in `state_dict()` (JSON-able; saved in checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from podsrl.algo.advantages import grpo_advantages
from podsrl.algo.selection import selection_metrics
from podsrl.batch import Problem, RolloutBatch
from podsrl.prompt_stats import PromptStats


class ConfigView(Protocol):
    """The run's config as a method reads it: podsrl.config.Config, which composes its sections from the method
    registry, so the methods describe what they read here instead of importing it. A method reads these fields
    and its own section, `cfg.<name>` (an instance of its `section`); tests/methods/test_config_view.py holds this
    description to Config and to what the methods read."""

    method: str
    rewards: list[Any]
    rollout: RolloutView
    algo: AlgoView
    filter: FilterView
    log: LogView

    def __getattr__(self, section: str) -> Any: ...  # a method's own section


class RolloutView(Protocol):
    prompts_per_step: int
    n: int


class AlgoView(Protocol):
    scale: str
    advantage_epsilon: float
    epsilon_low: float
    epsilon_high: float


class FilterView(Protocol):
    zero_variance: bool


class LogView(Protocol):
    grad_noise: bool


# (problems, indices, counts) -> counts[j] scored rollouts of problems[indices[j]]; group_index refers to `problems`
Generate = Callable[[list[Problem], list[int], list[int]], RolloutBatch]
# an early stop of a group's episodes: (rewards of its finished episodes, count still live) -> whether to stop them
EpisodeStopRule = Callable[[torch.Tensor, int], bool]
# token modulation: (advantages, log_ratio, logprobs, entropy, mask) -> ([B, T] factor, metrics)
TokenModulation = Callable[..., tuple[torch.Tensor, dict[str, float]]]


@dataclass
class StepContext:
    """What a method may touch during one step (built by the loop each step)."""

    cfg: ConfigView
    stats: PromptStats  # run-long per-prompt history; the loop records each collected batch once
    rng: torch.Generator  # the run's generator (random rules, rejection)
    step: int  # 0-based index of the step being taken
    epoch: int  # completed passes over a finite training set at the step's first problem (0 for a stream)
    epoch_size: int  # problems in one pass of a finite training set; 0 for an unbounded stream
    pad_token_id: int
    generate: Generate  # sample and score; the loop times it and counts what the reward policy drops
    draw: Callable[[int], list[Problem]]  # the next problems of the sampler (pre-rollout filters, refills)


class Method:
    """Plain GRPO, and the defaults every method inherits."""

    name: ClassVar[str] = ""
    # The dataclass of the method's own config section (`cfg.<name>`, YAML key `<name>:`), or None for no options.
    section: ClassVar[type | None] = None
    # False for a method that sizes its own groups and ignores rollout.n (so rollout.n = 1 is no error).
    uses_rollout_n: ClassVar[bool] = True

    def __init__(self, cfg: ConfigView) -> None:
        self.cfg = cfg

    @classmethod
    def validate(cls, cfg: ConfigView) -> None:
        """Cross-field checks of the method's own section; raise ConfigError naming the key."""

    @classmethod
    def trained_per_prompt(cls, cfg: ConfigView) -> int:
        """The most rollouts of one prompt a step trains (what the memory plan sizes the update for)."""
        return cfg.rollout.n

    def collect(self, problems: list[Problem], ctx: StepContext) -> tuple[RolloutBatch, dict[str, float]]:
        """The step's scored rollouts and collection metrics: rollout.n of each prompt."""
        n = self.cfg.rollout.n
        return ctx.generate(problems, list(range(len(problems))), [n] * len(problems)), {}

    def select(self, batch: RolloutBatch, ctx: StepContext) -> tuple[RolloutBatch, dict[str, float]]:
        """The rows that enter the update, with `.advantages` set: here every row, GRPO advantages."""
        rows = torch.arange(batch.num_rollouts)
        kept = batch.select_rows(rows)
        kept.advantages = self.grpo_advantages(kept)
        return kept, selection_metrics(batch.rewards, batch.group_index, batch.num_groups, rows)

    def grpo_advantages(self, kept: RolloutBatch, basis: RolloutBatch | None = None) -> torch.Tensor:
        """GRPO advantages (algo.scale) of `kept`, with group statistics over `basis` (default: `kept` itself)."""
        a = self.cfg.algo
        stats = (basis.rewards, basis.group_index) if basis is not None else (None, None)
        return grpo_advantages(kept.rewards, kept.group_index, kept.num_groups, a.scale, a.advantage_epsilon, *stats)

    def refill_count(self, missing: int, zero_variance_fraction: float) -> int:
        """Prompts to draw in a zero-variance refill round when `missing` informative groups are short."""
        return missing

    def episode_stop_rule(self) -> EpisodeStopRule | None:
        """For a task with episodes: a rule the runner asks between turns of whether a group's live episodes can
        stop, their tokens never generated, because its finished episodes already decide what it trains (their
        rewards, the count still live); None (every episode runs to its end). Never asked for single-turn tasks."""
        return None

    def token_modulation(self) -> TokenModulation | None:
        """A per-token advantage factor applied in the update (DynaMO), or None."""
        return None

    def end_step(self, generated: list[RolloutBatch], ctx: StepContext) -> dict[str, float]:
        """Called once per step with every batch collected for it, when its batch is complete (after select and
        refills), before the next step's collect; returns extra step metrics. With train.async it runs on the
        generator, in step order, while the learner may be updating: it must not read the policy."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 (a stateless method has nothing to restore)
        pass


def offline_context(cfg: ConfigView, rng: torch.Generator, stats: PromptStats | None = None) -> StepContext:
    """A context for calling a method's `select` on a ready batch outside the loop (tests, benchmarks): it cannot
    generate or draw problems."""

    def unavailable(*_args):
        raise RuntimeError("offline_context: no engine or sampler outside the training loop")

    return StepContext(cfg=cfg, stats=stats if stats is not None else PromptStats(), rng=rng, step=0, epoch=0,
                       epoch_size=0, pad_token_id=0, generate=unavailable, draw=unavailable)
