"""What an episode talks to: the `Environment` protocol, and `ToolEnvironment`, an environment whose only action is
calling its tools.

An episode is a conversation: `reset(problem)` gives its first messages (the prompt), then after each model turn
`step(assistant_text)` gives the messages the model reads next and whether the episode is over. Messages are chat
messages ({"role": ..., "content": ...}), rendered by the tokenizer's chat template with the environment's `tools`.
The reward comes at the end, over the whole episode's text, from the run's reward functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from podsrl.batch import Problem
from podsrl.episodes.tools import ToolResult, call_tools, parse_tool_calls


class Environment(Protocol):
    tools: list[Callable]  # functions the model may call (their schemas go into the prompt); [] for none
    tool_results: list[ToolResult]  # every tool call of the current episode, in order (the step's metrics)

    def reset(self, problem: Problem) -> list[dict]: ...

    def step(self, assistant_text: str) -> tuple[list[dict], bool]: ...


class ToolEnvironment:
    """The problem's prompt as the user's message; a model turn with tool calls gets their results, one "tool"
    message each, and the episode goes on; a turn without one is the answer and ends it."""

    def __init__(self, tools: list[Callable], tool_timeout_s: float) -> None:
        self.tools = list(tools)
        self.by_name = {f.__name__: f for f in self.tools}
        self.tool_timeout_s = tool_timeout_s
        self.tool_results: list[ToolResult] = []

    def reset(self, problem: Problem) -> list[dict]:
        self.tool_results = []
        return [{"role": "user", "content": problem.prompt}]

    def step(self, assistant_text: str) -> tuple[list[dict], bool]:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            return [], True
        results = call_tools(calls, self.by_name, self.tool_timeout_s)
        self.tool_results.extend(results)
        return [{"role": "tool", "name": r.name, "content": r.content} for r in results], False
