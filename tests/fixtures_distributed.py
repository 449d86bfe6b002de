"""A reward that varies on an untrained model's output (share of digits), so end-to-end data-parallel runs train
on non-zero advantages from the first step."""

from __future__ import annotations


def digit_share(prompts, completions, **columns) -> list[float]:
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in completions]
