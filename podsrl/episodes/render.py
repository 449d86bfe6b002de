"""Token ids of an episode's messages, as the model sees them.

With a chat template: the prompt is the first messages rendered with the environment's tools and the generation
prompt; after a model turn, the environment's messages are what the template writes after an assistant turn (its
end-of-turn, the messages, the next generation prompt), found as TRL does: render a fixed two-message conversation
with and without them and keep the difference. Without a chat template (the built-in char-level model): the
messages' contents as they are, a tool's result as `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

from collections.abc import Callable

from podsrl.errors import ConfigError

RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"
_MARK = "\x00assistant turn\x00"  # the fixed conversation's assistant content: found again in its rendering


class EpisodeRenderer:
    def __init__(self, tokenizer, tools: list[Callable]) -> None:
        self.tokenizer, self.tools = tokenizer, tools or None
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def _template(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt(self, messages: list[dict]) -> list[int]:
        if self.templated:
            return self._ids(self._template(messages, True))
        return self._ids("".join(m["content"] for m in messages))

    def continuation(self, messages: list[dict], stop_token: int | None) -> list[int]:
        """The environment's `messages` after a model turn that ended at `stop_token` (None: it ended without one,
        at the end of a tool call). A stop token the template would write again is not repeated."""
        if not self.templated:
            return self._ids("".join(f"{RESPONSE_START}{m['content']}{RESPONSE_END}" if m["role"] == "tool"
                                     else m["content"] for m in messages))
        fixed = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        before = self._template(fixed, False)
        after = self._template(fixed + messages, True)
        cut = before.rindex(_MARK) + len(_MARK)
        if after[:cut] != before[:cut]:
            raise ConfigError("task: the tokenizer's chat template renders earlier turns differently once later "
                              "messages follow, so an episode cannot grow turn by turn")
        text = after[cut:]
        if stop_token is not None:
            stop_text = self.tokenizer.decode([stop_token])
            if stop_text and text.startswith(stop_text):
                text = text[len(stop_text):]
        return self._ids(text)
