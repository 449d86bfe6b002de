"""The built-in task: sums of 2 or 3 integers of 1-2 digits, e.g. "47+8+93=" -> "148".

Hard enough for the tiny model that a short supervised warm-up leaves it part-way (carries across three operands are
what it gets wrong longest), so RL has room to climb; and mixed, so prompts differ in how often the model solves
them, which is what variance-based selection and allocation feed on. Problems are a pure function of (seed, index):
the data position of a run is one integer. Held-out problems come from a separate stream and never appear in
training. Training draws from an unbounded stream, or with `train_size` N from a pool of its first N problems,
visited in order epoch after epoch (so per-prompt statistics build up).
"""

from __future__ import annotations

import random

from podsrl.batch import Problem
from podsrl.errors import ConfigError
from podsrl.tasks.base import Task


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(self, seed: int = 1234, eval_size: int = 2000, operands: int = 3, digits: int = 2,
                 min_operands: int = 2, train_size: int = 0) -> None:
        if isinstance(train_size, bool) or not isinstance(train_size, int) or train_size < 0:
            raise ConfigError(f"task.args.train_size: must be a whole number >= 0 (0 = an unbounded stream of "
                              f"problems), got {train_size!r}")
        # A finite pool: problem(i) is problem(i % train_size), so prompts recur (per-prompt history for DynaMO).
        self.train_size = train_size
        if operands < 2:
            raise ConfigError("task.args.operands: must be >= 2")
        if not 1 <= digits <= 9:
            raise ConfigError("task.args.digits: must be in 1..9")
        self.seed, self.operands, self.digits = seed, operands, digits
        self.min_operands = min_operands
        if not 2 <= self.min_operands <= operands:
            raise ConfigError("task.args.min_operands: must be in [2, task.args.operands]")
        self._eval = [self._make(random.Random(f"eval-{seed}-{i}"), f"eval-{i}") for i in range(eval_size)]
        self._eval_prompts = {p.prompt for p in self._eval}

    def _make(self, rng: random.Random, uid: str) -> Problem:
        k = rng.randint(self.min_operands, self.operands)
        # Digit count drawn first so short and long operands are equally common (uniform values would be ~90% long).
        values = [rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)
                  for d in (rng.randint(1, self.digits) for _ in range(k))]
        return Problem(uid=uid, prompt="+".join(map(str, values)) + "=", answer=str(sum(values)))

    def __len__(self) -> int:
        """Training problems in one epoch; 0 for the unbounded stream."""
        return self.train_size

    def problem(self, index: int) -> Problem:
        if self.train_size:
            index %= self.train_size
        attempt = 0
        while True:  # skip the (rare) collisions with held-out problems
            p = self._make(random.Random(f"train-{self.seed}-{index}-{attempt}"), f"train-{index}")
            if p.prompt not in self._eval_prompts:
                return p
            attempt += 1

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        return completion.strip() == problem.answer

    def reference_completion(self, problem: Problem) -> str:
        return problem.answer
