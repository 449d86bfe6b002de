"""The built-in task: sums of 2 or 3 integers of 1-2 digits, e.g. "47+8+93=" -> "148".

With `operators: "+*"` (any of + - *) each operator is drawn from those, and the answer is the expression's value
with the usual precedence: "47*8+93=" -> "469". Products of two-digit numbers are beyond what the tiny model does in
its head: the problems of `arithmetic_python`, where a program computes them.

With `solution: worked` the completion is a short worked solution, the running sums left to right, then ';' and
the answer: "47+8+93=" -> "47+8=55,55+93=148;148". Completions are several times longer, and one wrong running
sum makes the answer wrong: the regime of reasoning chains that rollout-efficiency methods target. The working makes a problem
easier to learn than its bare answer (the default model's warm-up on 2-4 operands: 33% after 400 steps worked, 7.5%
after 600 bare), so a harder task comes from more operands or digits.

Hard enough for the tiny model that a short supervised warm-up leaves it part-way (carries across three operands are
what it gets wrong longest), so RL has room to climb; and mixed, so prompts differ in how often the model solves
them, which is what variance-based selection and allocation feed on. Problems are a pure function of (seed, index):
the data position of a run is one integer. Training draws from an unbounded stream, or with `train_size` N from a
pool of its first N problems, visited in order epoch after epoch (so per-prompt statistics build up).

Held-out and training problems come from one distribution, split by a fixed partition of the prompt space: a prompt
is held-out iff a hash of (seed, prompt) falls in the first `holdout_fraction` of its range. The hash ignores
difficulty, so both sides keep the same mix of operand counts and sizes, and no held-out prompt is ever trained on.
(Rejecting training draws that collide with a sampled eval list instead would skew training away from the small
problem types the eval list covers almost completely, e.g. the 100 one-digit pairs.)
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import re

from podsrl.batch import Problem
from podsrl.errors import ConfigError
from podsrl.tasks.base import Task

SOLUTIONS = ("answer", "worked")
ANSWER_MARKER = ";"  # ends a worked solution; what follows the last one is the answer that is checked
OPERATORS = "+-*"


def split_expression(prompt: str) -> tuple[list[str], list[str]]:
    """("47*8+93=") -> (["47", "8", "93"], ["*", "+"]): the operands and the operators between them."""
    parts = re.split(r"([-+*])", prompt.rstrip("="))
    return parts[0::2], parts[1::2]


def expression_value(prompt: str) -> int:
    """The value of a prompt's expression, products first: "47*8+93=" -> 469."""
    operands, operators = split_expression(prompt)
    total, sign, term = 0, 1, int(operands[0])
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            term *= int(x)
        else:
            total, sign, term = total + sign * term, 1 if op == "+" else -1, int(x)
    return total + sign * term


def join_expression(values, ops) -> str:
    return "".join(f"{v}{op}" for v, op in zip(values, [*ops, "="]))


def worked_solution(values: list[int]) -> str:
    """The running sums left to right, then the answer: [47, 8, 93] -> "47+8=55,55+93=148;148"."""
    steps, total = [], values[0]
    for v in values[1:]:
        steps.append(f"{total}+{v}={total + v}")
        total += v
    return ",".join(steps) + ANSWER_MARKER + str(total)


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(self, seed: int = 1234, eval_size: int = 2000, operands: int = 3, digits: int = 2,
                 min_operands: int = 2, holdout_fraction: float = 0.1, train_size: int = 0,
                 solution: str = "answer", operators: str = "+") -> None:
        if isinstance(train_size, bool) or not isinstance(train_size, int) or train_size < 0:
            raise ConfigError(f"task.args.train_size: must be a whole number >= 0 (0 = an unbounded stream of "
                              f"problems), got {train_size!r}")
        # A finite pool: problem(i) is problem(i % train_size), so prompts recur (per-prompt history for the methods that read it).
        self.train_size = train_size
        if operands < 2:
            raise ConfigError("task.args.operands: must be >= 2")
        if not 1 <= digits <= 9:
            raise ConfigError("task.args.digits: must be in 1..9")
        self.seed, self.operands, self.digits = seed, operands, digits
        self.min_operands = min_operands
        if not 2 <= self.min_operands <= operands:
            raise ConfigError("task.args.min_operands: must be in [2, task.args.operands]")
        if not 0.0 < holdout_fraction < 1.0:
            raise ConfigError("task.args.holdout_fraction: must be in (0, 1)")
        self.holdout_fraction = holdout_fraction
        if solution not in SOLUTIONS:
            raise ConfigError(f"task.args.solution: must be 'answer' (the sum alone) or 'worked' (running sums, then "
                              f"'{ANSWER_MARKER}' and the sum), got {solution!r}")
        self.solution = solution
        if not isinstance(operators, str) or not operators or not set(operators) <= set(OPERATORS) \
                or len(set(operators)) != len(operators):
            raise ConfigError(f"task.args.operators: must be distinct characters of {OPERATORS!r} (e.g. '+*'), got "
                              f"{operators!r}")
        if solution == "worked" and operators != "+":
            raise ConfigError("task.args.solution: 'worked' solutions are running sums; they need operators '+'")
        self.operators = operators
        self._small_holdout: dict[tuple[int, ...], frozenset[str]] = {}
        # One stream for the whole eval list; training draws are a pure function of their index instead.
        rng, self._eval = random.Random(f"eval-{seed}"), []
        while len(self._eval) < eval_size:
            p = self._make(rng, f"eval-{len(self._eval)}")
            if self.is_heldout(p.prompt):
                self._eval.append(p)

    def _make(self, rng: random.Random, uid: str) -> Problem:
        k = rng.randint(self.min_operands, self.operands)
        # Digit count drawn first so short and long operands are equally common (uniform values would be ~90% long).
        values = [rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)
                  for d in (rng.randint(1, self.digits) for _ in range(k))]
        # drawn after the values, so a sums-only task's problems are those it always had
        ops = [rng.choice(self.operators) for _ in values[1:]] if len(self.operators) > 1 else self.operators * (k - 1)
        prompt = join_expression(values, ops)
        return Problem(uid=uid, prompt=prompt, answer=str(expression_value(prompt)))

    def _hash(self, prompt: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{self.seed}:{prompt}".encode(), digest_size=8).digest(), "big")

    def _small_shape_holdout(self, shape: tuple[tuple[int, ...], tuple[str, ...]]) -> frozenset[str]:
        """Exactly round(fraction * K) held-out prompts of a shape with K <= 10^4 prompts (at least one).

        A hash threshold alone leaves a binomial share of a small shape held out (6 of the 100 one-digit pairs, say),
        which would skew the held-out mix; ranking the shape's prompts by hash makes the share exact.
        """
        if shape not in self._small_holdout:
            digits, ops = shape
            ranges = [range(0, 10) if d == 1 else range(10 ** (d - 1), 10**d) for d in digits]
            prompts = [join_expression(values, ops) for values in itertools.product(*ranges)]
            take = max(1, round(self.holdout_fraction * len(prompts)))
            self._small_holdout[shape] = frozenset(sorted(prompts, key=self._hash)[:take])
        return self._small_holdout[shape]

    def is_heldout(self, prompt: str) -> bool:
        operands, ops = split_expression(prompt)
        shape = tuple(len(x) for x in operands), tuple(ops)
        if math.prod(10 if d == 1 else 9 * 10 ** (d - 1) for d in shape[0]) <= 10**4:
            return prompt in self._small_shape_holdout(shape)
        return self._hash(prompt) < int(self.holdout_fraction * 2**64)

    def __len__(self) -> int:
        """Training problems in one epoch; 0 for the unbounded stream."""
        return self.train_size

    def problem(self, index: int) -> Problem:
        if self.train_size:
            index %= self.train_size
        attempt = 0
        while True:  # rejection keeps the training side's distribution equal to the held-out side's
            p = self._make(random.Random(f"train-{self.seed}-{index}-{attempt}"), f"train-{index}")
            if not self.is_heldout(p.prompt):
                return p
            attempt += 1

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        """'answer': the whole completion, whitespace stripped, is the sum. 'worked': the text after the completion's
        last ';', whitespace stripped, is the sum; the working before it is not checked, and a completion without
        ';' is wrong (an answer must be marked as one)."""
        if self.solution == "worked":
            _, marker, answer = completion.rpartition(ANSWER_MARKER)
            return bool(marker) and answer.strip() == problem.answer
        return completion.strip() == problem.answer

    def reference_completion(self, problem: Problem) -> str:
        if self.solution == "worked":
            return worked_solution([int(x) for x in problem.prompt.rstrip("=").split("+")])
        return problem.answer
