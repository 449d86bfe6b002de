"""Per-prompt success history over the whole run: shared infrastructure every method may read (success and attempt
counts for posteriors and variances, streaks of all-correct / all-wrong visits, the newest outcomes).
The loop records each collected batch once (one "visit" per prompt per collect).

Keyed by `Problem.uid`. Saved in checkpoints as plain JSON-able lists (no pickle) and restored on resume; keys added
later load as empty from older checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from podsrl.algo.group_stats import group_outcomes

RING = 16  # newest correctness bits kept per prompt (the size of the reference buffer that reads them)


class PromptStats:
    def __init__(self) -> None:
        self._successes: dict[str, int] = {}  # run-long
        self._attempts: dict[str, int] = {}
        self._last: dict[str, tuple[int, int]] = {}  # the last visit's (successes, attempts)
        self._recent: dict[str, list[bool]] = {}  # the newest RING correctness bits, oldest first
        self._streaks: dict[str, tuple[int, int]] = {}  # consecutive (all-correct, all-wrong) visits, newest back

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
            easy, hard = self._streaks.get(uid, (0, 0))
            # an all-correct visit extends the easy streak and ends the hard one; a mixed visit ends both
            self._streaks[uid] = (easy + 1 if s == n else 0, hard + 1 if s == 0 else 0)

    def record(self, uids: list[str], group_index: torch.Tensor, correct: torch.Tensor) -> None:
        """Add one collected batch: `correct[r]` (bool) of row r belongs to prompt `uids[group_index[r]]`; rows are
        in generation order, which the ring of newest outcomes keeps."""
        attempts, successes = group_outcomes(group_index, correct, len(uids))
        keep = attempts > 0
        self.update(
            [u for u, k in zip(uids, keep.tolist()) if k], successes[keep].tolist(), attempts[keep].tolist()
        )
        for g, bit in zip(group_index.tolist(), correct.bool().tolist()):
            ring = self._recent.setdefault(uids[g], [])
            ring.append(bit)
            if len(ring) > RING:
                del ring[0]

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

    def recent(self, uid: str) -> list[bool]:
        """The newest (at most 16) correctness bits of a prompt, oldest first."""
        return list(self._recent.get(uid, []))

    def streaks(self, uids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """([P] consecutive all-correct visits, [P] consecutive all-wrong visits) up to the newest; 0 if unseen."""
        easy = torch.tensor([self._streaks.get(u, (0, 0))[0] for u in uids], dtype=torch.long)
        hard = torch.tensor([self._streaks.get(u, (0, 0))[1] for u in uids], dtype=torch.long)
        return easy, hard

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
            "recent": ["".join("1" if b else "0" for b in self._recent.get(u, [])) for u in uids],
            "easy_streaks": [self._streaks.get(u, (0, 0))[0] for u in uids],
            "hard_streaks": [self._streaks.get(u, (0, 0))[1] for u in uids],
        }

    def load_state_dict(self, state: dict) -> None:
        uids = state["uids"]
        self._successes = dict(zip(uids, (int(x) for x in state["successes"])))
        self._attempts = dict(zip(uids, (int(x) for x in state["attempts"])))
        self._last = {u: (int(s), int(n)) for u, s, n in
                      zip(uids, state.get("last_successes", []), state.get("last_attempts", []))}
        self._recent = {u: [c == "1" for c in bits] for u, bits in zip(uids, state.get("recent", [])) if bits}
        self._streaks = {u: (int(e), int(h)) for u, e, h in
                         zip(uids, state.get("easy_streaks", []), state.get("hard_streaks", []))}
