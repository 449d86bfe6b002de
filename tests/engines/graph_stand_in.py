"""A CUDA graph's contract on the CPU, for the decode-step tests: a capture records the step's operations on the
tensors it read, and a replay runs those operations again on the same memory, whatever the Python objects hold
by then. So a path that re-allocates a tensor a graph read (a new object, or `set_`/`.data` swapping an object's
storage) without the engine dropping its graphs replays on the old memory here too, as a GPU would: the suite sees
the stale values instead of re-reading the current tensors."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from podsrl.engines.decode_step import CudaGraphs


class _Op:
    """One recorded operation: its arguments bound to the captured memory, its outputs the graph's own tensors."""

    def __init__(self, func, args, kwargs, outputs) -> None:
        self.func, self.args, self.kwargs, self.outputs = func, args, kwargs, outputs
        # a view (or an in-place write's result): every output shares memory with an argument, as it did at capture
        # (not read off the schema: reshape, for one, copies where it cannot view)
        read = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        self.view = all(t.untyped_storage().data_ptr() in read for t in _tensors(outputs))

    def replay(self) -> None:
        if self.view and not self.func._schema.is_mutable:  # fixed at capture, its memory its base's
            return
        result = self.func(*self.args, **self.kwargs)  # an in-place or out= write lands in the captured memory
        if not self.view:
            for out, new in zip(_tensors(self.outputs), _tensors(result)):
                out.copy_(new)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    """Runs the step once, recording each aten operation. A tensor the step did not make (state, cache, weights,
    tables) is read through an alias made at its first use: the same memory, which a later re-allocation of the
    tensor (another object, or its storage swapped) does not move."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.made: dict[int, torch.Tensor] = {}  # id -> tensor the step made (kept alive: ids stay unique)
        self.aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the tensor read, its alias)

    def bound(self, value):
        if not isinstance(value, torch.Tensor) or id(value) in self.made:
            return value
        if id(value) not in self.aliases:
            self.aliases[id(value)] = (value, value.detach())
        return self.aliases[id(value)][1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a captured step read a device value on the host (.item(), .tolist()): a CUDA graph "
                               "capture cannot synchronise")
        args, kwargs = tree_map(self.bound, (args, kwargs or {}))
        outputs = func(*args, **kwargs)
        for out in tree_flatten(outputs)[0]:
            if isinstance(out, torch.Tensor):
                self.made.setdefault(id(out), out)
        self.ops.append(_Op(func, args, kwargs, outputs))
        return outputs


class RecordedGraph:
    def __init__(self, ops: list[_Op]) -> None:
        self.ops = ops

    def replay(self) -> None:
        for op in self.ops:
            op.replay()


class RecordedGraphs(CudaGraphs):
    """CudaGraphs whose capture records the step (see the module docstring); `captures` counts captures."""

    captures = 0

    def _capture(self, step):
        step()  # the warm-up run
        RecordedGraphs.captures += 1
        recorder = _Recorder()
        with recorder:
            outputs = step()
        return RecordedGraph(recorder.ops), outputs
