"""The built-in episode task: the arithmetic task with a calculator the model may call on any sub-sum.

An episode is the plain task's prompt ("47+8+93="); the model may answer at once, as in the plain task, or call

    <tool_call>{"name": "calculator", "arguments": {"expression": "47+8"}}</tool_call>

read `<tool_response>55</tool_response>` and go on. The answer checked is what follows the last tool response.
Problems and the held-out split are the plain task's. The warm-up's reference episodes teach the call syntax: a share
`tool_share` of them call the calculator on the sum of the first k operands (k drawn from 2 to all of them), read
its answer and give the sum; the rest answer at once, as in the plain task. So the warmed-up model does both, and RL
has calling, where to call, and answering at once to choose between.
"""

from __future__ import annotations

import ast
import json
import random

from podsrl.batch import Problem
from podsrl.episodes.environment import ToolEnvironment
from podsrl.episodes.render import RESPONSE_END, RESPONSE_START
from podsrl.episodes.tools import CALL_END, CALL_START
from podsrl.errors import ConfigError
from podsrl.tasks.arithmetic import ArithmeticTask

MAX_EXPRESSION = 64  # characters: products of longer integer expressions grow without bound
_OPERATORS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}


def calculator(expression: str) -> str:
    """Evaluates an integer expression.

    Args:
        expression: integers joined by +, - and *, with parentheses if needed, e.g. "47+8*(3-1)".
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))


def _evaluate(node: ast.AST) -> int:
    """The value of an integer +, -, * expression tree; anything else (names, calls, floats, /) is refused."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"not an integer +, -, * expression: {ast.unparse(node)!r}")


class ArithmeticToolTask(ArithmeticTask):
    name = "arithmetic_tool"
    # 1: reference episodes with calculator calls, validated on episodes (so episode.* counts in its warm-up key)
    warmup_version = 1
    # its sums are learned on bare answers (short rows) first; warmup.episode_steps on reference episodes then teach
    # the calls
    plain_task = "arithmetic"

    def __init__(self, tool_share: float = 0.5, **args) -> None:
        if isinstance(tool_share, bool) or not isinstance(tool_share, (int, float)) or not 0 <= tool_share <= 1:
            raise ConfigError(f"task.args.tool_share: must be a number in [0, 1] (the share of warm-up reference "
                              f"episodes that call the calculator), got {tool_share!r}")
        super().__init__(**args)
        if self.operators != "+":
            raise ConfigError(f"task.args.operators: the calculator's reference calls are sub-sums, so "
                              f"arithmetic_tool takes sums alone ('+'), got {self.operators!r}")
        self.tool_share = float(tool_share)

    @classmethod
    def plain_args(cls, args: dict) -> dict:
        return {k: v for k, v in args.items() if k != "tool_share"}

    def reference_turns(self, problem: Problem) -> list[tuple[str, str]]:
        """The answer at once, or (a share `tool_share`, drawn per problem) a calculator call on the sum of the first
        k operands, then the sum after its answer; the tool's answer written as the char-level model reads it."""
        rng = random.Random(f"turns-{self.seed}-{problem.uid}")
        if rng.random() >= self.tool_share:
            return super().reference_turns(problem)
        operands = problem.prompt.rstrip("=").split("+")
        expression = "+".join(operands[: rng.randint(2, len(operands))])
        call = CALL_START + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + CALL_END
        response = f"{RESPONSE_START}{calculator(expression)}{RESPONSE_END}"
        return [(problem.prompt, call), (problem.prompt + call + response, self.reference_completion(problem))]

    def environment(self, tool_timeout_s: float) -> ToolEnvironment:
        return ToolEnvironment([calculator], tool_timeout_s)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        """The plain task's check of the text after the episode's last tool response (all of it without one)."""
        return super().is_correct(completion.rpartition(RESPONSE_END)[2], problem)
