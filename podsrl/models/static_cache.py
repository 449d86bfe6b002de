"""The fast engine's static KV cache: per layer, buffers of fixed capacity written in place (`SlotLayer`), and
finished-row compaction that moves as few rows as finished (`compact`)."""

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


def compact(cache, finished: torch.Tensor, n_finished: int) -> torch.Tensor:
    """Drops the finished rows from the cache; returns the kept batch rows in their new order.

    The live rows past the new batch end move into the finished rows' places before it, so a static cache copies
    only as many rows as finished (other caches index-select the same order).
    """
    rows = finished.numel() - n_finished
    holes = finished[:rows].nonzero().squeeze(1)
    sources = (~finished[rows:]).nonzero().squeeze(1) + rows
    order = torch.arange(rows, device=finished.device)
    order[holes] = sources
    layers = getattr(cache, "layers", None) or []
    if layers and all(isinstance(layer, SlotLayer) for layer in layers):
        for layer in layers:
            layer.fill_holes(holes, sources, rows)
    else:
        cache.batch_select_indices(order)
    return order
