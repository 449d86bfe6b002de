"""A task is a source of problems plus how to check answers.

Training problems are addressed by an integer index (`problem(i)`), deterministic for a given task config and
seed, so the data position of a run is a single integer that a checkpoint stores and resume restores exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from podsrl.batch import Problem


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

    def reference_completion(self, problem: Problem) -> str:
        """A correct completion for supervised warm-up (built-in tasks only)."""
        raise NotImplementedError(f"task {self.name!r} has no reference completions for warm-up")
