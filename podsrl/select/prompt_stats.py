"""Per-prompt success history over the whole run, shared by AERO (Beta posterior) and DynaMO (Bernoulli variance).

Keyed by `Problem.uid`. Saved in checkpoints as plain JSON-able lists (no pickle) and restored on resume.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PromptStats:
    def __init__(self) -> None:
        self._successes: dict[str, int] = {}
        self._attempts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._attempts)

    def update(self, uids: Iterable[str], successes: Iterable[int], attempts: Iterable[int]) -> None:
        for uid, s, n in zip(uids, successes, attempts):
            s, n = int(s), int(n)
            if not 0 <= s <= n:
                raise ValueError(f"prompt {uid!r}: successes {s} not in [0, attempts={n}]")
            self._successes[uid] = self._successes.get(uid, 0) + s
            self._attempts[uid] = self._attempts.get(uid, 0) + n

    def update_from_groups(self, uids: list[str], group_index: torch.Tensor, correct: torch.Tensor) -> None:
        """Add one step's rollouts: `correct[r]` (bool) of row r belongs to prompt `uids[group_index[r]]`."""
        attempts = torch.bincount(group_index, minlength=len(uids))
        successes = torch.bincount(group_index, weights=correct.float(), minlength=len(uids)).round().long()
        keep = attempts > 0
        self.update(
            [u for u, k in zip(uids, keep.tolist()) if k], successes[keep].tolist(), attempts[keep].tolist()
        )

    def counts(self, uids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """([P] successes, [P] attempts) as long tensors; unseen prompts are 0/0."""
        s = torch.tensor([self._successes.get(u, 0) for u in uids], dtype=torch.long)
        n = torch.tensor([self._attempts.get(u, 0) for u in uids], dtype=torch.long)
        return s, n

    def posterior_mean(self, uids: list[str], alpha0: float = 1.0, beta0: float = 1.0) -> torch.Tensor:
        """[P] mean of Beta(alpha0 + S, beta0 + F) for each prompt."""
        s, n = self.counts(uids)
        return (alpha0 + s.double()) / (alpha0 + beta0 + n.double())

    def state_dict(self) -> dict:
        uids = sorted(self._attempts)
        return {
            "uids": uids,
            "successes": [self._successes.get(u, 0) for u in uids],
            "attempts": [self._attempts[u] for u in uids],
        }

    def load_state_dict(self, state: dict) -> None:
        self._successes = dict(zip(state["uids"], (int(x) for x in state["successes"])))
        self._attempts = dict(zip(state["uids"], (int(x) for x in state["attempts"])))
