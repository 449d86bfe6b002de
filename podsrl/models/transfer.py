"""Tensors between host and device in as few copies, and as few host waits, as the data allows.

Each pageable host-to-device copy, and each read of a device value on the host (float(), item()), makes the host
wait until the device has run everything queued before it (a sync), and a waiting host queues no work:
- `to_device`: host tensors onto the device joined into one buffer per dtype, pinned on CUDA and copied without
  waiting (the caching host allocator keeps the pinned buffer until the copy is done); each comes back as a view;
- `host_values`: 0-dim device tensors read back in one transfer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


def to_device(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """`tensors` (any shapes) on `device`, in their order: host tensors in one copy per dtype, device tensors as
    they are. With `device` the CPU the copies are no-ops (views of the joined buffers), the same code path."""
    out: list[Tensor | None] = [None if t.device.type == "cpu" else t for t in tensors]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if out[i] is None:
            by_dtype.setdefault(t.dtype, []).append(i)
    for indices in by_dtype.values():
        joined = torch.cat([tensors[i].reshape(-1) for i in indices])
        if device.type == "cuda":
            joined = joined.pin_memory()
        moved = joined.to(device, non_blocking=True)
        for i, part in zip(indices, moved.split([tensors[i].numel() for i in indices])):
            out[i] = part.view(tensors[i].shape)
    return out


def host_values(values: list) -> Iterator[float]:
    """Python floats of `values` (0-dim floating tensors, on any device, or numbers), in order, read in one
    transfer per device: each float() of a device tensor would make the host wait for the device once. Each is the float that
    float(value) gives (float32 and float64 widen to float64 exactly)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read: dict[int, float] = {}
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for group in by_device.values():  # stacked in their promoted dtype, then widened: exact for floating ones
        for t, x in zip(group, torch.stack([t.detach() for t in group]).to(torch.float64).tolist()):
            read[id(t)] = x
    return iter([read[id(v)] if isinstance(v, torch.Tensor) else float(v) for v in values])
