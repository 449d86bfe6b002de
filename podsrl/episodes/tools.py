"""Tools of an episode: plain Python functions the model calls by name.

A tool is a function with type hints and a docstring with an `Args:` section, as TRL and transformers' chat
templates take them (`apply_chat_template(messages, tools=[f, ...])` builds the JSON schemas from them). The model
calls one in the format of Qwen2.5's chat template:

    <tool_call>{"name": "calculator", "arguments": {"expression": "47+8"}}</tool_call>

Each call runs on its own thread, all calls of a turn at once, against one deadline. What a tool returns must be a
string, a number or a bool; anything else is junk. A call that cannot be parsed, names no tool of the episode,
raises, runs past the deadline or returns junk answers the model with an error message and counts as a fault of
that tool (a hung call's thread is abandoned: Python cannot stop it).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
INVALID = "invalid"  # the tool name a call is counted under when it names no tool of the episode
_SCALARS = (str, int, float, bool)


@dataclass(frozen=True)
class ToolResult:
    name: str  # the tool called, or INVALID
    content: str  # what the model reads
    fault: bool


def parse_tool_calls(text: str) -> list[str]:
    """The bodies of the complete tool calls in `text`, in order."""
    return _CALL.findall(text)


def _resolve(body: str, tools: dict[str, Callable]) -> tuple[str, Callable, dict] | ToolResult:
    """(name, function, arguments) of a call body, or the fault it is."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolResult(INVALID, f"error: the tool call is not JSON ({e.msg})", True)
    if not isinstance(call, dict) or not isinstance(call.get("arguments", {}), dict):
        return ToolResult(INVALID, 'error: a tool call is {"name": ..., "arguments": {...}}', True)
    name = call.get("name")
    if name not in tools:
        return ToolResult(INVALID, f"error: no tool named {name!r} (tools: {', '.join(tools)})", True)
    return name, tools[name], call.get("arguments", {})


def call_tools(bodies: list[str], tools: dict[str, Callable], timeout_s: float) -> list[ToolResult]:
    """Run the calls concurrently, each given `timeout_s` seconds; one result per call, in order."""
    resolved = [_resolve(b, tools) for b in bodies]
    outcomes: list[list] = [[] for _ in bodies]  # each thread appends ("value" | "error", ...) to its own list
    threads: list[threading.Thread | None] = []
    for call, outcome in zip(resolved, outcomes):
        if isinstance(call, ToolResult):
            threads.append(None)
            continue
        _, fn, arguments = call
        thread = threading.Thread(target=_invoke, args=(fn, arguments, outcome), daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    results = []
    for call, outcome, thread in zip(resolved, outcomes, threads):
        if thread is None:
            results.append(call)
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        name = call[0]
        if not outcome:
            results.append(ToolResult(name, f"error: {name} took longer than {timeout_s:g} s", True))
            continue
        kind, value = outcome[0]
        if kind == "error":
            results.append(ToolResult(name, f"error: {name} raised {type(value).__name__}: {value}", True))
        elif not isinstance(value, _SCALARS):
            results.append(ToolResult(name, f"error: {name} returned a {type(value).__name__}, not a string or "
                                            "number", True))
        else:
            results.append(ToolResult(name, str(value), False))
    return results


def _invoke(fn: Callable, arguments: dict, outcome: list) -> None:
    try:
        outcome.append(("value", fn(**arguments)))
    except Exception as e:  # any failure of the tool is the episode's error message, not the run's
        outcome.append(("error", e))
