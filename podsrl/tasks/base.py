"""A task is a source of problems plus how to check answers.

Training problems are addressed by an integer index (`problem(i)`), deterministic for a given task config and
seed, so the data position of a run is a single integer that a checkpoint stores and resume restores exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from podsrl.batch import Problem

if TYPE_CHECKING:
    from podsrl.episodes.environment import Environment


class Task(ABC):
    name: str = "task"
    # Reward functions (names in podsrl.rewards' registry, or "module:function") used when the config lists none.
    default_rewards: tuple[str, ...] = ("correct",)

    @abstractmethod
    def problem(self, index: int) -> Problem:
        """Training problem number `index` (0, 1, 2, ...; datasets wrap around in reshuffled epochs)."""

    @abstractmethod
    def eval_set(self) -> list[Problem]:
        """The fixed held-out problems (same list every call for a given config)."""

    def is_correct(self, completion: str, problem: Problem) -> bool:
        """The verifier's correctness bit. Tasks with their own verifier override this."""
        raise NotImplementedError(f"task {self.name!r} has no built-in verifier; configure a 'correct' reward")

    def score(self, completion: str, problem: Problem) -> float:
        """The verifier's reward in [0, 1] (1.0/0.0 unless the task gives partial credit); see `has_verifier`."""
        return 1.0 if self.is_correct(completion, problem) else 0.0

    def score_batch(self, completions: list[str], problems: list[Problem],
                    environments: list[Environment] | None = None) -> list[float]:
        """`score` for many rollouts at once (the `correct` reward calls this; override to vectorise).
        `environments`: each episode's environment, once it is over (None for single-turn completions)."""
        return [self.score(c, p) for c, p in zip(completions, problems)]

    def has_verifier(self) -> bool:
        """True when the task overrides `is_correct`, `score` or `score_batch`: the `correct` reward then uses the
        task's own verifier; otherwise it falls back to math-verify against `Problem.answer`."""
        cls = type(self)
        return (cls.is_correct is not Task.is_correct or cls.score is not Task.score
                or cls.score_batch is not Task.score_batch)

    def environment(self, tool_timeout_s: float) -> Environment | None:
        """A fresh environment for one episode (podsrl/episodes), or None: the task's rollouts are single-turn
        completions of the prompt. `tool_timeout_s` is episode.tool_timeout_s."""
        return None

    def has_environment(self) -> bool:
        """True when the task overrides `environment`: its rollouts are episodes."""
        return type(self).environment is not Task.environment

    def reference_completion(self, problem: Problem) -> str:
        """A correct completion for supervised warm-up (built-in tasks only)."""
        raise NotImplementedError(f"task {self.name!r} has no reference completions for warm-up")

    def reference_turns(self, problem: Problem) -> list[tuple[str, str]]:
        """A correct episode as the warm-up trains on it: (context, model turn) pairs, each context the text the
        model reads before that turn (the prompt, earlier turns and the environment's answers), on which there is
        no loss. A single-turn task's is its prompt and reference completion."""
        return [(problem.prompt, self.reference_completion(problem))]
