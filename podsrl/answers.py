"""Where a completion's answer is: the text that math-verify checks against the gold answer.

The order, first match wins:
1. the last `<answer>...</answer>` block with something in it (an unclosed last block runs to the end);
2. else the last `\\boxed{...}` (or `\\fbox{...}`), braces matched: what a base math model writes;
3. else the last `max_chars` characters (long completions are capped so parsing time stays bounded).
"""

from __future__ import annotations

BOXES = ("\\boxed{", "\\fbox{")


def boxed_span(text: str) -> tuple[int, int] | None:
    """(start, end) of the last \\boxed{...} or \\fbox{...} in `text`, nested braces matched; None if there is
    none or its braces never close."""
    start = max(text.rfind(box) for box in BOXES)
    if start < 0:
        return None
    depth = 0
    for j in range(text.index("{", start), len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return start, j + 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}); None if there is none, it is empty or its braces never
    close."""
    span = boxed_span(text)
    if span is None:
        return None
    inner = text[span[0]:span[1]]
    return inner[inner.index("{") + 1:-1].strip() or None


def answer_region(completion: str, max_chars: int = 2000) -> str:
    """The part of a completion that is checked (the order is in the module docstring)."""
    start = completion.rfind("<answer>")
    if start >= 0:
        end = completion.find("</answer>", start)
        inner = completion[start + len("<answer>"): end if end >= 0 else None]
        if inner.strip():
            return inner[-max_chars:]
    span = boxed_span(completion)
    if span is not None:
        return completion[span[0]:span[1]][-max_chars:]
    return completion[-max_chars:]
