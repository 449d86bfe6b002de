"""Prompt length: what happens to prompts longer than `task.max_prompt_length` tokens (verl's
`filter_overlong_prompts`, TRL's `max_prompt_length`), decided once at start-up.

  filter        drop the problem (counted and reported at start-up),
  truncate_left keep the last max_prompt_length tokens (the question's end and the generation prompt survive),
  error         stop with the file and row named.

The limit is checked against the model's context together with the completion budget (`rollout.max_new_tokens`, an
episode task's `episode.max_tokens`) before any generation, so a prompt can never make an engine allocate past the
model's positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from podsrl.batch import Problem
from podsrl.errors import ConfigError, DataError

log = logging.getLogger("podsrl")

POLICIES = ("filter", "truncate_left", "error")


def resolve_limit(max_prompt_length: int, max_new_tokens: int, context: int | None,
                  budget_key: str = "rollout.max_new_tokens") -> int | None:
    """The prompt-token limit in force: task.max_prompt_length, or (0) whatever the context leaves after the
    completion (`max_new_tokens`, the config key `budget_key`). ConfigError when prompt + completion cannot fit the
    model's context."""
    if context is None:
        return max_prompt_length or None
    room = context - max_new_tokens
    if room < 1:
        raise ConfigError(f"{budget_key}: {max_new_tokens} leaves no room for a prompt in the model's "
                          f"context of {context} tokens (max_position_embeddings)")
    if max_prompt_length > room:
        raise ConfigError(f"task.max_prompt_length: {max_prompt_length} + {budget_key} "
                          f"{max_new_tokens} exceeds the model's context of {context} tokens; lower one of them")
    return max_prompt_length or room


def token_lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    """Each prompt's tokens as the engines receive it (the chat template is already in the text)."""
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids] if texts else []


@dataclass
class PromptLimit:
    """Applies one policy to lists of problems."""

    tokenizer: Any
    max_tokens: int
    policy: str = "filter"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"task.overlong_prompts: {self.policy!r} is not one of {', '.join(POLICIES)}")

    def _length(self, texts: list[str]) -> list[int]:
        return token_lengths(self.tokenizer, texts)

    def _truncate(self, text: str) -> str:
        """The text of the last max_tokens tokens. Re-tokenising a cut text can merge differently at the cut, so
        the cut moves right until the text itself is within the limit."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        keep = self.max_tokens
        while True:
            cut = self.tokenizer.decode(ids[len(ids) - keep:], skip_special_tokens=False)
            if self._length([cut])[0] <= self.max_tokens or keep <= 1:
                return cut
            keep -= 1

    def apply(self, problems: list[Problem], labels: list[str]) -> tuple[list[Problem], list[str], int, int]:
        """(problems within the limit, their row labels such as 'train.jsonl: line 7', number filtered,
        number truncated), per the policy."""
        lengths = self._length([p.prompt for p in problems]) if problems else []
        kept, kept_labels, filtered, truncated = [], [], 0, 0
        for problem, label, n in zip(problems, labels, lengths):
            if n == 0 and problem.prompt.strip():
                raise DataError(f"{label}: the prompt encodes to no tokens with the model's tokenizer "
                                f"({type(self.tokenizer).__name__}): transformers loaded a tokenizer class that does "
                                "not read the tokenizer files in model.name_or_path (it picks the class from the "
                                "model type)")
            if n <= self.max_tokens:
                kept.append(problem)
                kept_labels.append(label)
            elif self.policy == "error":
                raise DataError(f"{label}: the prompt is {n} tokens, longer than the limit of {self.max_tokens} "
                                "(task.max_prompt_length); shorten it, or set task.overlong_prompts to filter or "
                                "truncate_left")
            elif self.policy == "filter":
                filtered += 1
            else:
                kept.append(replace(problem, prompt=self._truncate(problem.prompt)))
                kept_labels.append(label)
                truncated += 1
        return kept, kept_labels, filtered, truncated


def limit_task_prompts(task: Any, tokenizer: Any, max_prompt_length: int, policy: str, max_new_tokens: int,
                       context: int | None, budget_key: str = "rollout.max_new_tokens") -> int | None:
    """Check the limit against the model's context and apply it to the task (tasks with a finite problem list);
    one start-up log line says what was filtered or truncated. Returns the limit in force."""
    limit = resolve_limit(max_prompt_length, max_new_tokens, context, budget_key)
    if limit is None or not hasattr(task, "limit_prompts"):
        return limit
    rule = PromptLimit(tokenizer, limit, policy)
    counts = task.limit_prompts(rule)  # {"train": (filtered, truncated), "eval": (filtered, truncated)}
    done = [f"{what} {kind}: {n}" for what, (f, t) in counts.items() for kind, n in (("filtered", f),
                                                                                     ("truncated", t)) if n]
    source = "task.max_prompt_length" if max_prompt_length else f"model context - {budget_key}"
    log.info("prompt length: limit %d tokens (%s), overlong prompts %s%s", limit, source,
             "filter" if policy == "filter" else policy, f"; {', '.join(done)}" if done else "; none overlong")
    return limit


STREAM_SAMPLE = 2000  # training problems read from an unbounded stream (its eval set comes from the same generator)


def longest_prompt(task: Any, tokenizer: Any) -> int:
    """The longest prompt in tokens (as PromptLimit counts them) of the task's training problems (an unbounded
    stream's first STREAM_SAMPLE) and its eval set."""
    size = (len(task) if hasattr(task, "__len__") else 0) or STREAM_SAMPLE
    texts = [task.problem(i).prompt for i in range(size)] + [p.prompt for p in task.eval_set()]
    return max(token_lengths(tokenizer, texts), default=1)
