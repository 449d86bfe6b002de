"""What an episode talks to: the `Environment` protocol, and `ToolEnvironment`, an environment whose only action is
calling its tools.

An episode is a conversation: `reset(problem)` gives its first messages (the prompt), then after each model turn
`step(assistant_text)` gives the messages the model reads next and whether the episode is over (and may give the
turn's reward: `(messages, done, reward)`). Messages are chat messages ({"role": ..., "content": ...}), rendered by
the tokenizer's chat template with the environment's `tools`. What a `reset` or `step` returns is checked: another
shape stops the run naming the class, the method and what it returned (`EnvironmentShapeError`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Protocol

from podsrl.batch import Problem
from podsrl.episodes.formats import HERMES, ToolFormat
from podsrl.episodes.tools import ResponseLimit, ToolResult, call_tools
from podsrl.errors import UserError


class Environment(Protocol):
    tools: list[Callable]  # functions the model may call (their schemas go into the prompt); [] for none
    tool_results: list[ToolResult]  # every tool call of the current episode, in order (the step's metrics)

    def reset(self, problem: Problem) -> list[dict]: ...

    def step(self, assistant_text: str) -> tuple[list[dict], bool] | tuple[list[dict], bool, float]: ...


class EnvironmentShapeError(UserError):
    """An environment's reset or step returned something other than what the protocol says."""


MESSAGES = "a list of {'role': str, 'content': str} messages"


def _shown(value: object) -> str:
    text = repr(value)
    return f"{text[:80]}{'...' if len(text) > 80 else ''} (a {type(value).__name__})"


def _bad_messages(value: object) -> bool:
    return not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def checked_reset(label: str, value: object) -> list[dict]:
    """`label` ("MyEnv.reset")'s return value, if it is a list of messages."""
    if _bad_messages(value):
        raise EnvironmentShapeError(f"episode: {label} returned {_shown(value)}; it returns {MESSAGES}")
    return value


def checked_step(label: str, value: object) -> tuple[list[dict], bool, float | None]:
    """(messages, done, the turn's reward or None) of `label` ("MyEnv.step")'s return value: (messages, done) or
    (messages, done, reward)."""
    shape = ("(messages, done) or (messages, done, reward): messages " + MESSAGES + ", done a bool, reward a "
             "number")
    ok = isinstance(value, tuple) and len(value) in (2, 3) and not _bad_messages(value[0]) and (
        isinstance(value[1], bool) or type(value[1]).__name__ == "bool_") and (
        len(value) == 2 or value[2] is None or (isinstance(value[2], numbers.Real) and not isinstance(value[2], bool)))
    if not ok:
        raise EnvironmentShapeError(f"episode: {label} returned {_shown(value)}; it returns {shape}")
    reward = value[2] if len(value) == 3 else None
    return value[0], bool(value[1]), None if reward is None else float(reward)


class ToolEnvironment:
    """The problem's prompt as the user's message; a model turn with tool calls gets their results, one "tool"
    message each, in order, and the episode goes on; a turn without one is the answer and ends it. The runner
    `configure`s the run's call format and limits."""

    def __init__(self, tools: list[Callable], tool_timeout_s: float) -> None:
        self.tools = list(tools)
        self.by_name = {f.__name__: f for f in self.tools}
        self.tool_timeout_s = tool_timeout_s
        self.tool_results: list[ToolResult] = []
        self.tool_format: ToolFormat = HERMES
        self.max_parallel_calls = 8
        self.response_limit = ResponseLimit()

    def configure(self, tool_format: ToolFormat, max_parallel_calls: int, response_limit: ResponseLimit) -> None:
        self.tool_format, self.max_parallel_calls, self.response_limit = tool_format, max_parallel_calls, \
            response_limit

    def reset(self, problem: Problem) -> list[dict]:
        self.tool_results = []
        return [{"role": "user", "content": problem.prompt}]

    def step(self, assistant_text: str) -> tuple[list[dict], bool]:
        calls = self.tool_format.parse(assistant_text)
        if not calls:
            return [], True
        results = call_tools(calls, self.by_name, self.tool_timeout_s, self.max_parallel_calls, self.response_limit)
        self.tool_results.extend(results)
        return [self.tool_format.tool_message(c, r.name, r.content, i)
                for i, (c, r) in enumerate(zip(calls, results))], False
