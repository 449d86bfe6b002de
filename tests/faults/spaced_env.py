"""A TRL-style environment whose text has spaces (docs/episodes.md's example, with a wordier reset and tool answer),
for the episode resume test: the resumed run must tokenize this text as the killed run did."""

from __future__ import annotations


class SpacedSumsEnv:
    def __init__(self) -> None:
        self.answer, self.sums = None, []

    def reset(self, answer, **row) -> str:
        self.answer, self.sums = answer, []
        return " Use add, then say the sum."

    def add(self, a: int, b: int) -> str:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.sums.append(a + b)
        return f"the sum is {a + b}"

    def get_reward(self) -> float:
        return 1.0 if self.sums and str(self.sums[-1]) == str(self.answer) else 0.0
