"""Per-prompt success history over the whole run: shared infrastructure every method may read (AERO's Beta posterior,
DynaMO's Bernoulli variance, ...). The loop records each collected batch once (one "visit" per prompt per collect).

Keyed by `Problem.uid`. Saved in checkpoints as plain JSON-able lists (no pickle) and restored on resume; keys added
later load as empty from older checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PromptStats:
    def __init__(self) -> None:
        self._successes: dict[str, int] = {}  # run-long
        self._attempts: dict[str, int] = {}
        self._last: dict[str, tuple[int, int]] = {}  # the last visit's (successes, attempts)

    def __len__(self) -> int:
        return len(self._attempts)

    def update(self, uids: Iterable[str], successes: Iterable[int], attempts: Iterable[int]) -> None:
        """Add one visit of each prompt: `successes[i]` of `attempts[i]` rollouts of prompt `uids[i]` were correct."""
        for uid, s, n in zip(uids, successes, attempts):
            s, n = int(s), int(n)
            if not 0 <= s <= n:
                raise ValueError(f"prompt {uid!r}: successes {s} not in [0, attempts={n}]")
            self._successes[uid] = self._successes.get(uid, 0) + s
            self._attempts[uid] = self._attempts.get(uid, 0) + n
            self._last[uid] = (s, n)

    def record(self, uids: list[str], group_index: torch.Tensor, correct: torch.Tensor) -> None:
        """Add one collected batch: `correct[r]` (bool) of row r belongs to prompt `uids[group_index[r]]`."""
        attempts = torch.bincount(group_index, minlength=len(uids))
        successes = torch.bincount(group_index, weights=correct.float(), minlength=len(uids)).round().long()
        keep = attempts > 0
        self.update(
            [u for u, k in zip(uids, keep.tolist()) if k], successes[keep].tolist(), attempts[keep].tolist()
        )

    def counts(self, uids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """([P] successes, [P] attempts) over the run as long tensors; unseen prompts are 0/0."""
        s = torch.tensor([self._successes.get(u, 0) for u in uids], dtype=torch.long)
        n = torch.tensor([self._attempts.get(u, 0) for u in uids], dtype=torch.long)
        return s, n

    def last_visit(self, uids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """([P] successes, [P] attempts) of each prompt's most recent visit; unseen prompts are 0/0."""
        s = torch.tensor([self._last.get(u, (0, 0))[0] for u in uids], dtype=torch.long)
        n = torch.tensor([self._last.get(u, (0, 0))[1] for u in uids], dtype=torch.long)
        return s, n

    def posterior_mean(self, uids: list[str], alpha0: float = 1.0, beta0: float = 1.0) -> torch.Tensor:
        """[P] mean of Beta(alpha0 + S, beta0 + F) for each prompt."""
        s, n = self.counts(uids)
        return (alpha0 + s.double()) / (alpha0 + beta0 + n.double())

    def copy(self) -> PromptStats:
        out = PromptStats()
        out.load_state_dict(self.state_dict())
        return out

    def state_dict(self) -> dict:
        uids = sorted(self._attempts)
        return {
            "uids": uids,
            "successes": [self._successes.get(u, 0) for u in uids],
            "attempts": [self._attempts[u] for u in uids],
            "last_successes": [self._last.get(u, (0, 0))[0] for u in uids],
            "last_attempts": [self._last.get(u, (0, 0))[1] for u in uids],
        }

    def load_state_dict(self, state: dict) -> None:
        uids = state["uids"]
        self._successes = dict(zip(uids, (int(x) for x in state["successes"])))
        self._attempts = dict(zip(uids, (int(x) for x in state["attempts"])))
        self._last = {u: (int(s), int(n)) for u, s, n in
                      zip(uids, state.get("last_successes", []), state.get("last_attempts", []))}
