"""Tools of an episode: plain Python functions the model calls by name.

A tool is a function with type hints and a docstring with an `Args:` section, as TRL and transformers' chat
templates take them (`apply_chat_template(messages, tools=[f, ...])` builds the JSON schemas from them). The model
calls one in its family's format (podsrl/episodes/formats.py); in Qwen2.5's:

    <tool_call>{"name": "calculator", "arguments": {"expression": "47+8"}}</tool_call>

The calls of a turn run concurrently (at most episode.max_parallel_calls at once) on the process's call pool
(podsrl/episodes/calls.py), each against episode.tool_timeout_s, and are answered in order. What a tool returns
must be a string, a number or a bool; anything else is junk, and so is a NaN or infinite float (no answer to
pass on). A call that cannot be read, names no tool of the episode, raises (SystemExit and KeyboardInterrupt
included, named as such), runs past its time limit or returns junk answers the model with an error message and
counts as a fault of that tool (a call that names no tool: `invalid`). What a tool returns is cut to
episode.max_response_chars characters before anything tokenizes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from podsrl.episodes.calls import CALLS, Call, Outcome
from podsrl.episodes.formats import CALL_END, CALL_START, InvalidCall, ToolCall

__all__ = ["CALL_END", "CALL_START", "INVALID", "ResponseLimit", "ToolResult", "call_tools"]

INVALID = "invalid"  # the tool name a call is counted under when it cannot be read or names no tool of the episode
_SCALARS = (str, int, float, bool)
CUT_END, CUT_START, CUT_MIDDLE = "...(truncated)", "(truncated)...", "...(truncated)..."  # verl's marks


@dataclass(frozen=True)
class ToolResult:
    name: str  # the tool called, or INVALID
    content: str  # what the model reads
    fault: bool
    truncated: bool = False  # the tool's answer was longer than the response limit and was cut


@dataclass(frozen=True)
class ResponseLimit:
    """verl's max_tool_response_length and tool_response_truncate_side, in characters: a longer text keeps its
    start (left), its end (right) or both halves (middle), marked as cut, `max_chars` characters in all (so a cut
    text is never cut again)."""

    max_chars: int = 8192
    side: str = "middle"

    def cut(self, text: str) -> tuple[str, bool]:
        if len(text) <= self.max_chars:
            return text, False
        if self.side == "left":
            return text[: self.max_chars - len(CUT_END)] + CUT_END, True
        if self.side == "right":
            return CUT_START + text[len(text) - self.max_chars + len(CUT_START):], True
        keep = self.max_chars - len(CUT_MIDDLE)
        return text[: keep // 2] + CUT_MIDDLE + text[len(text) - (keep - keep // 2):], True


def call_tools(calls: list[ToolCall | InvalidCall], tools: dict[str, Callable], timeout_s: float,
               parallel: int = 8, limit: ResponseLimit = ResponseLimit()) -> list[ToolResult]:
    """One result per call, in order; the calls that name a tool run concurrently, `parallel` at most at once."""
    runnable = [c for c in calls if isinstance(c, ToolCall) and c.name in tools]
    outcomes = iter(CALLS.run([Call(c.name, tools[c.name], kwargs=c.arguments, limit_s=timeout_s)
                               for c in runnable], parallel))
    results = []
    for call in calls:
        if isinstance(call, InvalidCall):
            results.append(ToolResult(INVALID, call.error, True))
        elif call.name not in tools:
            results.append(ToolResult(INVALID, f"error: no tool named {call.name[:100]!r} (tools: "
                                               f"{', '.join(tools)})", True))
        else:
            results.append(_result(call.name, next(outcomes), timeout_s, limit))
    return results


def _result(name: str, outcome: Outcome, timeout_s: float, limit: ResponseLimit) -> ToolResult:
    """What the model reads of a call's outcome (an error message too is cut to the limit)."""
    fault = True
    if outcome.timed_out:
        text = f"error: {name} took longer than {timeout_s:g} s"
    elif outcome.error is not None:
        text = f"error: {name} raised {type(outcome.error).__name__}: {outcome.error}"
    elif not isinstance(outcome.value, _SCALARS):
        text = f"error: {name} returned a {type(outcome.value).__name__}, not a string or number"
    elif isinstance(outcome.value, float) and not math.isfinite(outcome.value):  # no answer: a fault, not "nan"
        text = f"error: {name} returned {outcome.value}, not a finite number"
    else:
        try:
            text, fault = str(outcome.value), False
        except ValueError as e:  # an integer past Python's digit limit
            text = f"error: {name} returned a number too long to print ({str(e).split(':')[0]})"
    content, truncated = limit.cut(text)
    return ToolResult(name, content, fault, truncated)
