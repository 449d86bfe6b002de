"""Tool-call formats: how a model family writes its calls, read back into name and arguments.

The chat template shows the model its tools and how to call them; the same family's format reads the calls out of
a model turn (`ToolFormat.parse`). A turn runs on to the model's end of turn, so one turn may hold several calls;
`stop_tokens` are the tokens besides EOS that end a turn (Llama's <|eom_id|>). The format is chosen from the
tokenizer's chat template (`format_for`), or named by `episode.tool_format`:

  hermes       Qwen2.5, Qwen3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a block per call.
               A call inside Qwen3's <think>...</think> is thought, not made.
  llama3_json  Llama 3.1-3.3: the turn is {"name": ..., "parameters": {...}}, after <|python_tag|> or plain,
               several separated by ";".
  mistral      Mistral (Nemo, Small 3): [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "9 letters"}, ...].
               Its template needs each tool message's call id (9 letters and digits): the call's own, else one made
               from the call's place.

A call that cannot be read (not JSON, nested deeper than MAX_DEPTH, a number past Python's 4,300 digits, a name that
is not a string, arguments that are not an object) is an `InvalidCall`: the model is told what was wrong, and it
counts under `invalid`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

log = logging.getLogger("podsrl")

MAX_DEPTH = 64  # JSON nesting of a call; deeper is refused before parsing (Python's parser recurses)
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    id: str | None = None  # the model's id for the call (Mistral), if any


@dataclass(frozen=True)
class InvalidCall:
    error: str  # what the model reads


def _depth(text: str) -> int:
    """Deepest nesting of [ and { outside JSON strings."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _decode(text: str, start: int = 0) -> tuple[object, int] | InvalidCall:
    """The JSON value at `start` of `text` and where it ends, or why it is no call."""
    if _depth(text[start:]) > MAX_DEPTH:
        return InvalidCall(f"error: the tool call nests deeper than {MAX_DEPTH} levels")
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError as e:
        return InvalidCall(f"error: the tool call is not JSON ({e.msg})")
    except (ValueError, RecursionError) as e:  # e.g. an integer past Python's digit limit
        return InvalidCall(f"error: the tool call is not JSON a tool can take ({str(e).split(':')[0][:120]})")


class ToolFormat:
    name = ""
    shape = '{"name": ..., "arguments": {...}}'  # what one call looks like, for the model's error messages
    stop_tokens: tuple[str, ...] = ()  # tokens besides EOS that end a model turn

    def parse(self, text: str) -> list[ToolCall | InvalidCall]:
        """The calls of a model turn, in order ([] for a turn without one: the answer)."""
        return [call for call, _ in self._calls(text)]

    def calls_end(self, text: str) -> int:
        """How many characters of `text` run through the end of its last call (0: none)."""
        spans = self._calls(text)
        return spans[-1][1] if spans else 0

    def _calls(self, text: str) -> list[tuple[ToolCall | InvalidCall, int]]:
        """Each call and the offset where it ends."""
        raise NotImplementedError

    def tool_message(self, call: ToolCall | InvalidCall, name: str, content: str, index: int) -> dict:
        """The message answering the turn's `index`-th call."""
        return {"role": "tool", "name": name, "content": content}

    def call_of(self, value: object) -> ToolCall | InvalidCall:
        if not isinstance(value, dict):
            return InvalidCall(f"error: a tool call is {self.shape}")
        name = value.get("name")
        if not isinstance(name, str):
            return InvalidCall(f"error: a tool call's name is a string, not {type(name).__name__}")
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # arguments as a JSON string, as OpenAI's API writes them
            decoded = _decode(arguments.strip())
            if isinstance(decoded, InvalidCall):
                return decoded
            arguments = decoded[0]
        if not isinstance(arguments, dict):
            return InvalidCall(f"error: a tool call's arguments are an object: {self.shape}")
        call_id = value.get("id")
        return ToolCall(name, arguments, call_id if isinstance(call_id, str) else None)


class HermesFormat(ToolFormat):
    name = "hermes"
    _CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
    _THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)

    def _calls(self, text: str) -> list[tuple[ToolCall | InvalidCall, int]]:
        visible = self._THINK.sub(lambda m: " " * len(m.group(0)), text)  # offsets kept
        calls = []
        for match in self._CALL.finditer(visible):
            body = match.group(1).strip()
            decoded = _decode(body)
            if isinstance(decoded, InvalidCall):
                calls.append((decoded, match.end()))
            elif body[decoded[1]:].strip():
                calls.append((InvalidCall("error: a tool call holds one JSON object"), match.end()))
            else:
                calls.append((self.call_of(decoded[0]), match.end()))
        return calls


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    shape = '{"name": ..., "parameters": {...}}'
    stop_tokens = ("<|eom_id|>",)
    PYTHON_TAG = "<|python_tag|>"

    def _calls(self, text: str) -> list[tuple[ToolCall | InvalidCall, int]]:
        start = len(text) - len(text.lstrip())
        if text.startswith(self.PYTHON_TAG, start):
            start += len(self.PYTHON_TAG)
            start += len(text[start:]) - len(text[start:].lstrip())
        if not text.startswith("{", start):
            return []
        calls = []
        while True:
            decoded = _decode(text, start)
            if isinstance(decoded, InvalidCall):
                return calls + [(decoded, len(text))]
            value, end = decoded
            calls.append((self.call_of(value), end))
            rest = text[end:].lstrip()
            if not rest.startswith(";"):
                return calls
            start = len(text) - len(rest) + 1
            start += len(text[start:]) - len(text[start:].lstrip())
            if not text.startswith("{", start):
                return calls


class MistralFormat(ToolFormat):
    name = "mistral"
    shape = '[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]'
    MARK = "[TOOL_CALLS]"

    def _calls(self, text: str) -> list[tuple[ToolCall | InvalidCall, int]]:
        at = text.find(self.MARK)
        if at >= 0:
            start = at + len(self.MARK)
        else:  # decoded without special tokens, the mark is gone: a turn that is a list of objects
            start = len(text) - len(text.lstrip())
            if not re.match(r"\[\s*\{", text[start:]):
                return []
        start += len(text[start:]) - len(text[start:].lstrip())
        decoded = _decode(text, start)
        if isinstance(decoded, InvalidCall):
            return [(decoded, len(text))]
        value, end = decoded
        if not isinstance(value, list):
            value = [value]
        return [(self.call_of(v), end) for v in value] or [(InvalidCall(f"error: no call in {self.shape}"), end)]

    def tool_message(self, call: ToolCall | InvalidCall, name: str, content: str, index: int) -> dict:
        call_id = call.id if isinstance(call, ToolCall) and call.id and len(call.id) == 9 and call.id.isalnum() \
            else f"call{index:05d}"
        return {"role": "tool", "name": name, "content": content, "tool_call_id": call_id}


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}
HERMES = FORMATS["hermes"]
_WARNED: set[str] = set()  # templates already said to show no format


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The format a chat template shows its model, or None where it shows none."""
    template = chat_template or ""
    if MistralFormat.MARK in template:
        return FORMATS["mistral"]
    if CALL_START in template:
        return HERMES
    if '"parameters"' in template and ("ipython" in template or Llama3JsonFormat.PYTHON_TAG in template):
        return FORMATS["llama3_json"]
    return None


def format_for(tokenizer, name: str = "auto") -> ToolFormat:
    """`episode.tool_format`: a format by name, or (auto) the one the tokenizer's chat template shows; Hermes where
    there is no template (the built-in model's calls) or it shows none (said once)."""
    if name != "auto":
        return FORMATS[name]
    template = getattr(tokenizer, "chat_template", None)
    found = detect_format(template)
    if found is None and template and template not in _WARNED:
        _WARNED.add(template)
        log.warning("episode: the chat template shows no tool-call format podsrl reads (%s); reading calls as %s "
                    "(set episode.tool_format)", ", ".join(FORMATS), HERMES.name)
    return found or HERMES
