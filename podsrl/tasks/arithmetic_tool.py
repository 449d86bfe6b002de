"""The built-in episode task: the arithmetic task with a calculator the model may call on any sub-sum.

An episode is the plain task's prompt ("47+8+93="); the model may answer at once, as in the plain task, or call

    <tool_call>{"name": "calculator", "arguments": {"expression": "47+8"}}</tool_call>

read `<tool_response>55</tool_response>` and go on. The answer checked is what follows the last tool response.
Problems, the held-out split and the warm-up's reference completions (the bare answer) are the plain task's, so the
warm-up teaches the sums, not the call syntax.
"""

from __future__ import annotations

import ast

from podsrl.batch import Problem
from podsrl.episodes.environment import ToolEnvironment
from podsrl.episodes.render import RESPONSE_END
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

    def environment(self, tool_timeout_s: float) -> ToolEnvironment:
        return ToolEnvironment([calculator], tool_timeout_s)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        """The plain task's check of the text after the episode's last tool response (all of it without one)."""
        return super().is_correct(completion.rpartition(RESPONSE_END)[2], problem)
