"""Token ids of an episode's messages, as the model sees them.

With a chat template: the prompt is the first messages rendered with the environment's tools and the generation
prompt; after a model turn, the environment's messages are what the template writes after an assistant turn (its
end-of-turn, the messages, the next generation prompt), found as TRL does: render a fixed two-message conversation
followed by them and keep what follows the assistant's text. (How the template writes the assistant turn itself
may change once messages follow it, as Qwen3's drops an empty <think> block: the model wrote that part already.) Without a chat template (the built-in char-level model): the
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
        """The environment's `messages` after a model turn that ended at `stop_token` (None: it was cut, at its
        budget or after its last call). The model ended its turn itself there, so the template's end of turn (that
        token, or EOS where the turn ended at another of the format's, as Llama's <|eom_id|>) is not repeated."""
        if not self.templated:
            return self._ids("".join(f"{RESPONSE_START}{m['content']}{RESPONSE_END}" if m["role"] == "tool"
                                     else m["content"] for m in messages))
        fixed = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        after = self._template(fixed + messages, True)
        if _MARK not in after:
            raise ConfigError("task: the tokenizer's chat template does not write an assistant turn's text back, so "
                              "an episode cannot grow turn by turn")
        text = after[after.index(_MARK) + len(_MARK):]
        if stop_token is not None:
            for end in (self.tokenizer.decode([stop_token]), self.tokenizer.eos_token):
                if end and text.startswith(end):
                    text = text[len(end):]
                    break
        return self._ids(text)
