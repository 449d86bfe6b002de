"""The one batch object that flows through a step: generate -> score -> select -> advantages -> update.

Rows are rollouts (R of them). Each row carries an explicit `group_index` into `problems` (one group per prompt),
so groups may have unequal sizes from the start (rounds, per-prompt allocation) and nothing assumes a [P, n] reshape.
Stages add fields; they do not re-derive them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Problem:
    """One prompt of a task: what the model sees, and what the verifier needs."""

    uid: str  # stable across the run: keys per-prompt statistics (PromptStats)
    prompt: str  # text given to the tokenizer (already templated)
    answer: str  # gold answer for the verifier
    metadata: dict[str, Any] = field(default_factory=dict)  # extra dataset columns, passed to reward functions


@dataclass
class RolloutBatch:
    problems: list[Problem]  # P prompts of this step
    group_index: torch.Tensor  # [R] long, row -> index into problems
    prompt_ids: torch.Tensor  # [R, Lp] long, left-padded
    prompt_mask: torch.Tensor  # [R, Lp] long, 1 on real prompt tokens
    completion_ids: torch.Tensor  # [R, Lc] long, right-padded
    completion_mask: torch.Tensor  # [R, Lc] float, 1 on the tokens present in the context (EOS included)
    truncated: torch.Tensor  # [R] bool, stopped by max_new_tokens before EOS
    sampler_logprobs: torch.Tensor | None = None  # [R, Lc] float32, the sampler's log-probs of the sampled tokens
    completions: list[str] | None = None  # decoded completion texts
    rewards: torch.Tensor | None = None  # [R] float, weighted sum of reward functions
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [R] float (NaN = missing)
    correct: torch.Tensor | None = None  # [R] bool, verifier correctness (used by per-prompt statistics)
    advantages: torch.Tensor | None = None  # [R] float, sequence-level advantage broadcast to tokens
    policy_version: torch.Tensor | None = None  # [R] long, the optimiser step whose weights sampled the row
    # [R, Lc] float, 1 on the tokens the model generated: an episode's tool and environment tokens are in the
    # context (completion_mask) but not trained on. None: every token present was generated (completion_mask).
    loss_mask: torch.Tensor | None = None
    # episodes under episode.credit: turn (podsrl/episodes/credit.py): [R, Lc] long turn of each completion token,
    # [R, T] float each turn's reward from its step, and [R, Lc] float token advantages (None: `advantages` holds)
    turn_index: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None
    token_advantages: torch.Tensor | None = None

    @property
    def num_rollouts(self) -> int:
        return int(self.group_index.numel())

    @property
    def num_groups(self) -> int:
        return len(self.problems)

    def group_sizes(self) -> torch.Tensor:
        """[P] long: rollouts per prompt (0 for a prompt whose rollouts were all dropped)."""
        return torch.bincount(self.group_index, minlength=self.num_groups)

    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1).long()

    @property
    def trained_mask(self) -> torch.Tensor:
        """[R, Lc] float, 1 on the tokens the loss, the KL and the rollout correction count."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    def select_rows(self, rows: torch.Tensor) -> RolloutBatch:
        """A batch holding only `rows` (long indices or bool mask); problems keep their indices."""
        if rows.dtype == torch.bool:
            rows = rows.nonzero(as_tuple=True)[0]
        changes: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "problems" or value is None:
                continue
            if isinstance(value, torch.Tensor):
                changes[f.name] = value[rows]
            elif f.name == "completions":
                changes[f.name] = [value[i] for i in rows.tolist()]
            elif f.name == "reward_components":
                changes[f.name] = {k: v[rows] for k, v in value.items()}
        return replace(self, **changes)

    def trim_padding(self) -> RolloutBatch:
        """Drop columns that are padding in every row (after selection the longest rows may be gone)."""
        prompt_keep = self.prompt_mask.any(dim=0)
        first = int(prompt_keep.nonzero()[0]) if prompt_keep.any() else self.prompt_mask.shape[1]
        length = int(self.completion_lengths().max()) if self.num_rollouts else 0
        out = replace(
            self,
            prompt_ids=self.prompt_ids[:, first:],
            prompt_mask=self.prompt_mask[:, first:],
            completion_ids=self.completion_ids[:, :length],
            completion_mask=self.completion_mask[:, :length],
        )
        if self.sampler_logprobs is not None:
            out.sampler_logprobs = self.sampler_logprobs[:, :length]
        for name in ("loss_mask", "turn_index", "token_advantages"):
            if getattr(self, name) is not None:
                setattr(out, name, getattr(self, name)[:, :length])
        return out


def concat_batches(batches: list[RolloutBatch], pad_token_id: int, disjoint: bool = False) -> RolloutBatch:
    """Concatenate rollouts, re-padding prompts left and completions right.

    By default all batches are over the same problems (e.g. sampling rounds). With `disjoint=True` each batch brings
    its own problems (e.g. refills of dynamic sampling): problem lists are appended and group indices shifted.
    """
    problems = batches[0].problems
    offsets = [0] * len(batches)
    if disjoint:
        problems = [p for b in batches for p in b.problems]
        for i in range(1, len(batches)):
            offsets[i] = offsets[i - 1] + batches[i - 1].num_groups
    else:
        for b in batches[1:]:
            if b.problems is not problems and [p.uid for p in b.problems] != [p.uid for p in problems]:
                raise ValueError("concat_batches needs batches over the same problems (or disjoint=True)")
    lp = max(b.prompt_ids.shape[1] for b in batches)
    lc = max(b.completion_ids.shape[1] for b in batches)

    def left(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    def right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    out = RolloutBatch(
        problems=problems,
        group_index=torch.cat([b.group_index + off for b, off in zip(batches, offsets)]),
        prompt_ids=torch.cat([left(b.prompt_ids, lp, pad_token_id) for b in batches]),
        prompt_mask=torch.cat([left(b.prompt_mask, lp, 0) for b in batches]),
        completion_ids=torch.cat([right(b.completion_ids, lc, pad_token_id) for b in batches]),
        completion_mask=torch.cat([right(b.completion_mask, lc, 0) for b in batches]),
        truncated=torch.cat([b.truncated for b in batches]),
    )
    if all(b.sampler_logprobs is not None for b in batches):
        out.sampler_logprobs = torch.cat([right(b.sampler_logprobs, lc, 0.0) for b in batches])
    if any(b.loss_mask is not None for b in batches):  # a batch without one trains every token it holds
        out.loss_mask = torch.cat([right(b.trained_mask, lc, 0) for b in batches])
    if all(b.turn_index is not None for b in batches):
        turns = max(b.turn_rewards.shape[1] for b in batches)
        out.turn_index = torch.cat([right(b.turn_index, lc, 0) for b in batches])
        out.turn_rewards = torch.cat([right(b.turn_rewards, turns, 0.0) for b in batches])
    if all(b.token_advantages is not None for b in batches):
        out.token_advantages = torch.cat([right(b.token_advantages, lc, 0.0) for b in batches])
    if all(b.completions is not None for b in batches):
        out.completions = [c for b in batches for c in b.completions]
    if all(b.advantages is not None for b in batches):
        out.advantages = torch.cat([b.advantages for b in batches])
    if all(b.rewards is not None for b in batches):
        out.rewards = torch.cat([b.rewards for b in batches])
        out.reward_components = {
            k: torch.cat([b.reward_components[k] for b in batches]) for k in batches[0].reward_components
        }
    if all(b.correct is not None for b in batches):
        out.correct = torch.cat([b.correct for b in batches])
    if all(b.policy_version is not None for b in batches):
        out.policy_version = torch.cat([b.policy_version for b in batches])
    return out
