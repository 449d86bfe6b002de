"""Turning a question into the text the model sees.

chat:  the tokenizer's own chat template (instruct models), an optional system message, and the generation
       prompt appended, so the completion starts where the assistant's turn starts.
plain: a format string (base models), e.g. "Question: {question}\\nAnswer:"; a system prompt, if any, goes first.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

from podsrl.errors import ConfigError

MODES = ("chat", "plain")

# Asks for the layout the `format` and `tag_count` rewards check.
THINK_ANSWER_SYSTEM_PROMPT = (
    "You are a helpful assistant. First reason about the problem step by step, then give the final answer. "
    "Respond in exactly this format:\n<think>\n...\n</think>\n<answer>\n...\n</answer>"
)


def check_template(template: str, key: str = "task.template") -> None:
    """A template must be a format string using exactly the field {question} (literal braces doubled)."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc} in {template!r} (write literal braces as {{{{ and }}}})") from exc
    if fields != {"question"}:
        extra = sorted(fields - {"question"})
        raise ConfigError(f"{key}: must contain {{question}}" + (f" and no other fields, found {extra}" if extra
                          else "") + f": {template!r}")


def build_prompt(
    question: str,
    tokenizer: Any = None,
    mode: str = "chat",
    system_prompt: str | None = None,
    template: str = "{question}",
) -> str:
    """The prompt text for one question (see the module docstring for the two modes)."""
    check_template(template)
    user = template.format(question=question)
    if mode == "plain":
        return f"{system_prompt}\n\n{user}" if system_prompt else user
    if mode != "chat":
        raise ConfigError(f"task.prompt_mode: {mode!r} is not one of {', '.join(MODES)}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError("task.prompt_mode: 'chat' needs a tokenizer with a chat template; this one has none "
                          "(a base model?), so use prompt_mode 'plain'")
    messages = [{"role": "user", "content": user}]
    if system_prompt:
        try:
            return tokenizer.apply_chat_template([{"role": "system", "content": system_prompt}, *messages],
                                                 tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - some templates (e.g. Gemma's) reject a system turn
            messages = [{"role": "user", "content": f"{system_prompt}\n\n{user}"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_formatter(
    tokenizer: Any = None, mode: str = "chat", system_prompt: str | None = None, template: str = "{question}"
) -> Callable[[str], str]:
    """`build_prompt` with the settings fixed (checked once, here), e.g. for DatasetTask(format_prompt=...)."""
    check_template(template)
    if mode not in MODES:
        raise ConfigError(f"task.prompt_mode: {mode!r} is not one of {', '.join(MODES)}")
    build_prompt("check", tokenizer, mode, system_prompt, template)  # fail now, not at the first problem
    return lambda question: build_prompt(question, tokenizer, mode, system_prompt, template)
