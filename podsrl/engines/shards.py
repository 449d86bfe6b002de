"""Splitting a generate() request into shards of whole prompt groups, and merging the shards' outputs back.

Used by the Ray actor pool (one shard per actor) and by data-parallel training (one shard per rank). Shards are
contiguous runs of prompts, so the merged rows come out in the same order as one unsharded call; with per-row seeds
(the fast engine) the merged output equals the unsharded one.

Episode sessions (one row per context, turn after turn) shard by episode instead (`EpisodeShards`): an episode
stays on the shard that holds its KV cache, so a shard's rows need not be contiguous and `merge_rows` puts them
back in the call's order.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, fields, replace

import torch

from podsrl.engines.base import GenerationOutput


@dataclass(frozen=True)
class Shard:
    """Prompts [start, end) of the request and their rows [row_start, row_end)."""

    start: int
    end: int
    row_start: int
    row_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


def shard_groups(counts: list[int], num_shards: int) -> list[Shard]:
    """`num_shards` contiguous prompt ranges with as equal row counts as whole groups allow (some may be empty).

    Shard k ends at the first prompt boundary where the running row count reaches k+1 shares of the total.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    cum = torch.tensor([0, *counts], dtype=torch.long).cumsum(0)  # cum[i] = rows before prompt i
    total = int(cum[-1])
    targets = torch.tensor([(k + 1) * total / num_shards for k in range(num_shards)], dtype=torch.float64)
    # Prompt boundary closest to each target (ties to the earlier one); the last one is the end of the request.
    after = torch.searchsorted(cum.double(), targets).clamp(max=len(counts))
    before = (after - 1).clamp(min=0)
    closer_before = (targets - cum[before].double()) <= (cum[after].double() - targets)
    ends = torch.where(closer_before, before, after)
    ends[-1] = len(counts)
    ends = torch.cummax(ends, 0).values.tolist()
    shards, start = [], 0
    for end in ends:
        shards.append(Shard(start, end, int(cum[start]), int(cum[end])))
        start = end
    return shards


def _pad(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)


def merge_outputs(parts: list[tuple[Shard, GenerationOutput]], pad_token_id: int,
                  with_logprobs: bool) -> GenerationOutput:
    """One output from shard outputs (in shard order): group indices shifted, prompts left- and completions
    right-padded to the widest shard."""
    parts = [(s, o) for s, o in parts if s.rows > 0]
    if not parts:
        raise ValueError("merge_outputs needs at least one non-empty shard")
    lp = max(o.prompt_ids.shape[1] for _, o in parts)
    lc = max(o.completion_ids.shape[1] for _, o in parts)
    outs = [o for _, o in parts]
    logprobs = None
    if with_logprobs:
        logprobs = torch.cat([_pad(o.logprobs, lc, 0.0, left=False) for o in outs])
    return GenerationOutput(
        group_index=torch.cat([o.group_index + s.start for s, o in parts]),
        prompt_ids=torch.cat([_pad(o.prompt_ids, lp, pad_token_id, left=True) for o in outs]),
        prompt_mask=torch.cat([_pad(o.prompt_mask, lp, 0, left=True) for o in outs]),
        completion_ids=torch.cat([_pad(o.completion_ids, lc, pad_token_id, left=False) for o in outs]),
        completion_mask=torch.cat([_pad(o.completion_mask, lc, 0, left=False) for o in outs]),
        truncated=torch.cat([o.truncated for o in outs]),
        logprobs=logprobs,
    )


class EpisodeShards:
    """Which shard generates each episode of a session: the one it was first given to (its KV cache lives there),
    for as long as it is live; an episode first seen goes to the shard with the fewest live episodes. An episode
    not in a call has ended and is forgotten. Deterministic in the calls' keys, so every rank of a torchrun run
    splits alike."""

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards
        self.home: dict[Hashable, int] = {}

    def split(self, keys: list) -> list[list[int]]:
        """Each shard's rows of a call (indices into `keys`, in call order)."""
        self.home = {key: self.home[key] for key in keys if key in self.home}
        load = [0] * self.num_shards
        for shard in self.home.values():
            load[shard] += 1
        for key in keys:
            if key not in self.home:
                self.home[key] = load.index(min(load))
                load[self.home[key]] += 1
        rows: list[list[int]] = [[] for _ in range(self.num_shards)]
        for row, key in enumerate(keys):
            rows[self.home[key]].append(row)
        return rows


def merge_rows(parts: list[tuple[list[int], GenerationOutput | None]], pad_token_id: int,
               with_logprobs: bool) -> GenerationOutput:
    """One output of a one-row-per-context call from its shards' outputs, `parts` pairing each shard's rows (indices
    into the call, as `EpisodeShards.split` gives them) with their output: rows back in the call's order."""
    parts = [(rows, out) for rows, out in parts if rows]
    shards, start = [], 0
    for rows, _ in parts:
        shards.append(Shard(start, start + len(rows), start, start + len(rows)))
        start += len(rows)
    merged = merge_outputs([(s, out) for s, (_, out) in zip(shards, parts)], pad_token_id, with_logprobs)
    order = torch.tensor([row for rows, _ in parts for row in rows]).argsort()
    reordered = {f.name: getattr(merged, f.name)[order] for f in fields(merged) if getattr(merged, f.name) is not None}
    reordered["group_index"] = torch.arange(len(order))  # one row per context
    return replace(merged, **reordered)
