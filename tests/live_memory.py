"""The peak bytes of tensor storage alive at once, counted at the dispatcher: what a piece of code holds on the CPU
as exactly as the CUDA allocator's peak would show it on a GPU (no allocator caching, no sampling)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakLiveBytes(TorchDispatchMode):
    """Inside `with PeakLiveBytes() as m:`, every storage an op makes is counted from its creation to its release;
    `m.peak` is the largest sum alive at once. Tensors made before the block are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._counted.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._counted:  # a view, or an in-place op's output
                continue
            self._counted.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, key, nbytes)
        return out
