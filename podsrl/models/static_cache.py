"""The fast engine's static KV caches and finished-row compaction that moves as few rows as finished.

- `SlotLayer`: one layer's K/V in buffers of fixed capacity written in place at a Python length, behind transformers'
  cache interface (prefill, and models run through their own forward);
- `StepCache`: every layer's K/V at fixed addresses for the engine's life, written at a column given as a tensor, for
  the static-shape decode step (a CUDA graph replays reading and writing the addresses it captured).
"""

from __future__ import annotations

import torch

from podsrl.models.transformers_api import DynamicLayer


class SlotLayer(DynamicLayer):  # type: ignore[misc,valid-type]
    """One layer's K/V in buffers of fixed capacity, written in place; attention sees only the filled prefix. The
    buffers hold exactly the live batch rows (after compaction, a view of the leading rows of the old ones), so a
    write or a read slices one dimension only."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, key_dim = key_states.shape
        # never read past the filled prefix, so left uninitialised
        self.key_buffer = key_states.new_empty(batch, heads, self.capacity, key_dim)
        self.value_buffer = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Starts the layer holding `keys`/`values` [B, heads, length, d] (a continued context's cached columns):
        the next update appends after them."""
        self.lazy_initialization(keys, values)
        self.length = keys.shape[-2]
        self.key_buffer[:, :, : self.length] = keys
        self.value_buffer[:, :, : self.length] = values
        self._view()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def _view(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.key_buffer = _select_prefix(self.key_buffer, indices, self.length)
            self.value_buffer = _select_prefix(self.value_buffer, indices, self.length)
            self._view()

    def fill_holes(self, holes: torch.Tensor, sources: torch.Tensor, rows: int) -> None:
        """Keeps the first `rows` rows, the finished ones among them (`holes`) overwritten by the live rows past
        the end (`sources`): only the filled prefix of as many rows as finished is copied, not the whole batch."""
        if holes.numel():
            self.key_buffer[holes, :, : self.length] = self.key_buffer[sources, :, : self.length]
            self.value_buffer[holes, :, : self.length] = self.value_buffer[sources, :, : self.length]
        self.key_buffer, self.value_buffer = self.key_buffer[:rows], self.value_buffer[:rows]
        self._view()


def _select_prefix(buffer: torch.Tensor, indices: torch.Tensor, length: int) -> torch.Tensor:
    """A buffer of the same capacity holding rows `indices` of `buffer`; only the filled prefix is copied."""
    out = buffer.new_empty((indices.numel(), *buffer.shape[1:]))
    torch.index_select(buffer[:, :, :length], 0, indices, out=out[:, :, :length])
    return out


def compaction_moves(finished: torch.Tensor, n_finished: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(holes, sources, order) that drop the finished rows of a batch: the live rows past the new batch end
    (`sources`) move into the finished rows' places before it (`holes`), so only as many rows as finished move;
    `order` [rows left] is the old batch row of each new one."""
    rows = finished.numel() - n_finished
    holes = finished[:rows].nonzero().squeeze(1)
    sources = (~finished[rows:]).nonzero().squeeze(1) + rows
    order = torch.arange(rows, device=finished.device)
    order[holes] = sources
    return holes, sources, order


def compact(cache, holes: torch.Tensor, sources: torch.Tensor, order: torch.Tensor) -> None:
    """Drops the finished rows from a transformers cache by compaction_moves' moves: a static cache copies only as
    many rows as finished, other caches index-select the same order."""
    layers = getattr(cache, "layers", None) or []
    if layers and all(isinstance(layer, SlotLayer) for layer in layers):
        for layer in layers:
            layer.fill_holes(holes, sources, order.numel())
    else:
        cache.batch_select_indices(order)


class StepCache:
    """Every layer's keys and values for the static-shape decode step, allocated once and zero-filled (a bucket's
    padding rows then compute on finite values): per layer one buffer [2, rows, kv_heads, positions, d], keys over
    values, so that a step writes both at its column, given as a tensor, in one op; `keys`/`values` are its halves.
    A step reads the leading rows and columns of its bucket."""

    def __init__(self, layers: int, rows: int, positions: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (2, rows, kv_heads, positions, head_dim)
        self.buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.keys = [buffer[0] for buffer in self.buffers]
        self.values = [buffer[1] for buffer in self.buffers]

    def load(self, prefill, expand: torch.Tensor | None, rows: int, start: int = 0) -> None:
        """Copies a prefill cache's layers (`SlotLayer`s) into rows [start:start + rows], prefill row `expand[r]`
        into row start + r (None: row r)."""
        for layer, keys, values in zip(prefill.layers, self.keys, self.values):
            width = layer.length
            for source, target in ((layer.keys, keys), (layer.values, values)):
                if expand is None:
                    target[start : start + rows, :, :width].copy_(source)
                else:
                    torch.index_select(source, 0, expand, out=target[start : start + rows, :, :width])

    def columns(self, row: int, start: int, end: int) -> torch.Tensor:
        """A copy of one row's keys and values over columns [start, end): [layers, 2, kv_heads, end - start, d]."""
        return torch.stack([torch.stack((k[row, :, start:end], v[row, :, start:end]))
                            for k, v in zip(self.keys, self.values)])

    def write(self, index: int, kv: torch.Tensor, rows: torch.Tensor, column: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes layer `index`'s keys stacked over its values kv [B, 2 kv_heads, 1, d] of rows [:B] (`rows`: arange(B)
        on the device), each at its `column` ([B] long), in one index_put_; returns their keys and values over
        columns [:length]."""
        buffer = self.buffers[index]
        buffer[:, rows, :, column] = kv[:, :, 0].unflatten(1, (2, -1))  # [B, 2, kv_heads, d]
        batch = kv.shape[0]
        return buffer[0, :batch, :, :length], buffer[1, :batch, :, :length]

    def fill_holes(self, holes: torch.Tensor, sources: torch.Tensor, filled: int) -> None:
        """Rows `sources` into rows `holes` (compaction_moves), their first `filled` columns only."""
        if holes.numel():
            for buffer in (*self.keys, *self.values):
                buffer[holes, :, :filled] = buffer[sources, :, :filled]
