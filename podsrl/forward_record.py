"""The sampling forward's projection outputs, kept for the update (`update.reuse_sampling_forward`).

With one pass over a step's batch (optim.epochs = optim.mini_batches = 1) the update runs under the weights that
sampled the batch, so the forward of every q/k/v, o, gate/up and down projection over each prompt token and each
completion input was computed while decoding. The fast engine keeps those outputs (`ForwardWriter.record`); the
shared-prompt update gathers them into its packed token stream (`source`, `gather`) and runs only the projections'
backward (podsrl/update/kernels.py `linear`): a third of the update's matmul work, and the same gradients up to
float rounding (decoding multiplies other matrix shapes). The rest of the forward (norms, rotary, attention, the
MLP's gate, the output layer) runs again, so everything the backward needs is the update's own.

The record names every output by its flat index: the prefill's [G, Lp] grid of left-padded prompts, row-major, then
each decode call's fed tokens in call order. Rows point into it (`prompt_start`, `completion_index`), so selecting
rollouts (PODS) selects index rows and copies nothing; `ids` lets the update check that the tokens it gathers are
the ones it computes on. Decoding writes the outputs in place into flat buffers (`ForwardBuffers`, through
`ForwardWriter`): kept per step as separate tensors and concatenated after, they cost a copy of every output and,
on CPU, fresh memory each step (page faults: more than the matmuls they save on a small model). The buffers go
back to the engine for its next call when the record is released after the update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
from torch import Tensor

# per decoder layer, the outputs kept: fused q/k/v projection, o_proj, fused gate/up projection, down_proj
LayerOutputs = tuple[Tensor, Tensor, Tensor, Tensor]


class ForwardBuffers:
    """Flat [capacity, features] buffers, per layer one for each projection, lent to one record at a time."""

    def __init__(self, features: list[tuple[int, ...]], capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.key = (features, dtype, device)
        self.capacity = capacity
        # one allocation carved into views: on CPU a large one is mapped apart from the heap, which then keeps the
        # same layout step after step (separate buffers of a few MB, held across steps, set glibc trimming and
        # refaulting the memory around them: thousands of page faults a step)
        storage = torch.empty(capacity * sum(map(sum, features)), dtype=dtype, device=device)
        sizes = [capacity * f for layer in features for f in layer]
        views = iter(storage.split(sizes))
        self.tensors = [tuple(next(views).view(capacity, f) for f in layer) for layer in features]
        self.lent = False

    def fits(self, features: list[tuple[int, ...]], capacity: int, dtype: torch.dtype, device: torch.device) -> bool:
        return not self.lent and self.key == (features, dtype, device) and capacity <= self.capacity


class ForwardWriter:
    """Where one generate call's forward calls write their projection outputs: consecutive slices of the buffers,
    the prefill's [G * Lp] first, then each decode call's live rows."""

    def __init__(self, buffers: ForwardBuffers) -> None:
        self.buffers = buffers
        buffers.lent = True
        self.used = 0
        self.start = 0
        self.decode: list[tuple[Tensor, Tensor]] = []  # per decode call: (output rows [B], fed tokens [B])

    def begin(self, tokens: int) -> None:
        """The next forward call computes `tokens` positions."""
        self.start, self.used = self.used, self.used + tokens

    def outputs(self, layer: int) -> LayerOutputs:
        """This call's [tokens, features] slices for the layer's projections."""
        return tuple(t[self.start : self.used] for t in self.buffers.tensors[layer])  # type: ignore[return-value]

    def record(self, prefill_ids: Tensor, prefill_mask: Tensor, expand: Tensor | None, rows: int) -> ForwardRecord:
        """The record of what was written: a prefill of [G, Lp] left-padded prompts (`expand`: each output row's
        prompt, None when they are one to one), then the decode calls `decode` lists."""
        groups, width = prefill_ids.shape
        outputs = [tuple(t[: self.used] for t in layer) for layer in self.buffers.tensors]
        device = outputs[0][0].device
        ids = torch.cat([prefill_ids.to(device).flatten()] + [tokens for _, tokens in self.decode])
        lengths = prefill_mask.sum(dim=1)
        starts = torch.arange(groups) * width + width - lengths
        prompt_start = starts if expand is None else starts[expand.cpu()]
        completion_index = torch.full((rows, len(self.decode)), -1, dtype=torch.long)
        if self.decode:
            fed = torch.tensor([len(live) for live, _ in self.decode])
            live = torch.cat([live for live, _ in self.decode]).cpu()
            step = torch.arange(len(self.decode)).repeat_interleave(fed)
            completion_index[live, step] = groups * width + torch.arange(int(fed.sum()))
        return ForwardRecord(outputs, ids, prompt_start, completion_index, buffers=self.buffers)


@dataclass
class ForwardRecord:
    outputs: list[LayerOutputs]  # per layer, each [T, features]: row t is flat token t's output
    ids: Tensor  # [T] the token each flat entry was computed on (device)
    prompt_start: Tensor  # [R] flat index of each row's first real prompt token (CPU)
    completion_index: Tensor  # [R, C] flat index of each row's completion input j; -1 where it was not fed (CPU)
    weights_version: int = -1  # the policy's optimiser-step count when sampled (set by the trainer)
    buffers: ForwardBuffers | None = field(default=None, repr=False)  # where `outputs` live, lent by the engine

    @classmethod
    def concat(cls, records: list[ForwardRecord | None],
               rows: list[Tensor | None]) -> tuple[ForwardRecord | None, Tensor | None]:
        """The record of batches concatenated in order (`rows`: each batch's rows of its record), with the rows of
        the concatenation; (None, None) when one has none or they saw different weights. Several records are copied
        into one (the update gathers from one tensor per output)."""
        present = [r for r in records if r is not None and r.outputs]
        row_lists = [r for r in rows if r is not None]
        if len(present) < len(records) or len(row_lists) < len(rows):
            return None, None
        if len({r.weights_version for r in present}) > 1:
            return None, None
        if len(present) == 1:
            return present[0], row_lists[0]
        flat = [0, *accumulate(r.ids.numel() for r in present)][:-1]
        first_row = [0, *accumulate(len(r.prompt_start) for r in present)][:-1]
        width = max(r.completion_index.shape[1] for r in present)

        def shifted(index: Tensor, offset: int) -> Tensor:  # -1 (not fed) stays -1, padded to the widest
            index = torch.nn.functional.pad(index, (0, width - index.shape[1]), value=-1)
            return torch.where(index >= 0, index + offset, index)

        merged = cls(
            outputs=[tuple(torch.cat(parts) for parts in zip(*layers))  # type: ignore[misc]
                     for layers in zip(*(r.outputs for r in present))],
            ids=torch.cat([r.ids for r in present]),
            prompt_start=torch.cat([r.prompt_start + off for r, off in zip(present, flat)]),
            completion_index=torch.cat([shifted(r.completion_index, off) for r, off in zip(present, flat)]),
            weights_version=present[0].weights_version,
        )
        return merged, torch.cat([r + off for r, off in zip(row_lists, first_row)])

    def release(self) -> None:
        """Hands the buffers back to the engine for its next call; the record holds nothing after."""
        self.outputs = []
        if self.buffers is not None:
            self.buffers.lent = False
            self.buffers = None

    def source(self, rows: Tensor, prompt_lengths: Tensor, input_lengths: Tensor, row_group: Tensor) -> Tensor | None:
        """[N] flat index of each token of a shared-prompt plan's packed stream: each distinct prompt's real tokens
        (in plan order, `row_group` [B] naming each row's), then each row's first input_lengths[b] completion
        inputs. `rows` [B] are the plan's rows as rows of this record. None when some input was not recorded or the
        record was released."""
        if not self.outputs:
            return None
        groups = int(row_group.max()) + 1 if row_group.numel() else 0
        first = torch.full((groups,), len(row_group)).scatter_reduce_(0, row_group, torch.arange(len(row_group)),
                                                                       "amin")
        lp = prompt_lengths[first]
        offsets = torch.arange(int(lp.sum())) - (lp.cumsum(0) - lp).repeat_interleave(lp)
        prompt = self.prompt_start[rows[first]].repeat_interleave(lp) + offsets
        width = int(input_lengths.max()) if input_lengths.numel() else 0
        if width > self.completion_index.shape[1]:
            return None
        inputs = torch.arange(width) < input_lengths[:, None]
        completion = self.completion_index[rows, :width][inputs]
        if bool((completion < 0).any()):
            return None
        return torch.cat([prompt, completion])

    def gather(self, source: Tensor, ids: Tensor, last_rows: Tensor, into: ForwardBuffers) -> list[LayerOutputs] | None:
        """The recorded outputs at `source` (on their device), per layer, written into the leading rows of `into`
        (the caller's buffers, reused from call to call: fresh tensors of this size cost page faults on CPU, more
        than the copy); the last layer's gate/up and down at source[last_rows] (the update runs that layer's MLP
        only where an output is read). None when the tokens at `source` are not `ids` (then this record is not the
        batch's)."""
        if not torch.equal(self.ids[source], ids):
            return None
        last_source = source[last_rows]
        out = []
        for i, (layer, buffers) in enumerate(zip(self.outputs, into.tensors)):
            sources = (source, source) + ((last_source,) * 2 if i == len(self.outputs) - 1 else (source,) * 2)
            out.append(tuple(torch.index_select(t, 0, s, out=b[: len(s)]) for t, s, b in zip(layer, sources, buffers)))
        return out  # type: ignore[return-value]

    def gather_buffers(self, previous: ForwardBuffers | None, tokens: int) -> ForwardBuffers:
        """`previous` when it can take `tokens` rows of every output, else buffers with room to spare."""
        features = [tuple(t.shape[1] for t in layer) for layer in self.outputs]
        first = self.outputs[0][0]
        if previous is not None and previous.fits(features, tokens, first.dtype, first.device):
            return previous
        return ForwardBuffers(features, tokens + tokens // 4, first.dtype, first.device)
