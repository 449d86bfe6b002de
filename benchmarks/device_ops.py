"""What a piece of torch code would cost a GPU in kernel launches and host syncs, counted on the CPU.

On the CPU every tensor is a host tensor, so "would this op launch a kernel / make the host wait?" is answered by
following where tensors would live in a run on a GPU (the code under count runs with its device set to the CPU):
`DeviceOps` marks as device tensors the tensors it is given (parameters, buffers, optimiser state), every result
of `.to(d)` naming a device (a host-to-device transfer), every tensor a factory made on a named device
(`torch.zeros(..., device=d)`) and everything computed from a device tensor. `.cpu()`, `.tolist()` and `float()`
are reads back to the host; tensors made without naming a device (a CPU-side index plan, a batch's columns) stay
host tensors and cost no launch and no sync, as on a GPU. Then, per phase (`with ops.phase(name):`; nested phases
count in the innermost):
- dispatches: ATen calls on device tensors, launching or not (the host's share of the work);
- launches: those less the metadata-only ones (views, reshapes without a copy, empty allocations);
- syncs: where the host waits for the device: a device value read on the host, an operation whose output size
  depends on device values (nonzero, boolean indexing, masked_select, unique, repeat_interleave without
  output_size, equal), and every transfer but a non-blocking one;
- transfers: host tensors moved to the device, by `.to(d)` or by being given to an operation on device tensors (a
  host index into a device tensor is copied there first). A pageable copy waits for the device; one asking for
  `non_blocking=True` does not (podsrl pins its source on CUDA);
- shapes: the distinct (operation, input shapes) of the matmuls and attention kernels.
A GPU's launch-bound time is roughly launches x 5-20 us (a kernel launch and torch's eager dispatch on a current
host). `count_syncs` counts on CUDA with torch's own sync debug mode instead.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# ATen operations that only make a new view or an uninitialised allocation: no kernel runs
METADATA_OPS = {
    "as_strided", "view", "_unsafe_view", "_reshape_alias", "reshape", "empty", "empty_strided", "empty_like",
    "new_empty", "new_empty_strided", "resolve_conj", "resolve_neg", "t", "transpose", "expand", "permute", "slice",
    "select", "unsqueeze", "squeeze", "detach", "alias", "lift_fresh", "split", "split_with_sizes", "chunk",
    "unbind", "narrow", "_to_copy_noop", "view_as", "unflatten", "flatten", "diagonal", "as_strided_", "set_",
    "_local_scalar_dense", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
}
# operations whose output depends on device values the host must see first
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "masked_scatter_backward", "_unique2", "unique_dim",
               "unique_consecutive", "equal"}
BOOL_INDEXING_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}  # a bool index runs nonzero
# kernels whose set-up a GPU library may redo for each new shape (cuBLAS heuristics, cuDNN plans); with attention
SHAPED_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"}
# Tensor methods that read a device tensor's values into the host
HOST_READS = {"tolist", "numpy", "cpu", "__array__"}


class DeviceOps:
    """Counts launches, syncs and transfers per phase while open (a context manager), as described above."""

    def __init__(self, device_tensors: Iterable[torch.Tensor] = ()) -> None:
        self._device: dict[int, weakref.ref] = {}
        for t in device_tensors:
            self.mark(t)
        self.dispatches: Counter[str] = Counter()  # every ATen call on device tensors, the launching ones and the rest
        self.launches: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.transfers: Counter[str] = Counter()
        self.launch_names: Counter[tuple[str, str]] = Counter()
        self.shapes: set[tuple] = set()  # (operation, input shapes) of the matmuls and attention kernels
        self.sync_names: Counter[tuple[str, str]] = Counter()
        self._phases = ["other"]
        self._stack = contextlib.ExitStack()

    # ---------------------------------------------------------------- marking

    def mark(self, t: torch.Tensor) -> None:
        key = id(t)
        self._device[key] = weakref.ref(t, lambda _, key=key: self._device.pop(key, None))

    def unmark(self, t: torch.Tensor) -> None:
        self._device.pop(id(t), None)

    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    # ---------------------------------------------------------------- phases and totals

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()

    @property
    def current(self) -> str:
        return self._phases[-1]

    def totals(self) -> dict[str, int]:
        return {"dispatches": sum(self.dispatches.values()), "launches": sum(self.launches.values()),
                "syncs": sum(self.syncs.values()),
                "transfers": sum(self.transfers.values())}

    def __enter__(self) -> DeviceOps:
        self._stack.enter_context(_Functions(self))
        self._stack.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _sync(self, what: str) -> None:
        self.syncs[self.current] += 1
        self.sync_names[(self.current, what)] += 1


class _Dispatch(TorchDispatchMode):
    def __init__(self, ops: DeviceOps) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ops = self.ops
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(ops.on_device(t) for t in inputs):
            return out
        name = func.overloadpacket.__name__
        if any(not ops.on_device(t) and t.dim() > 0 for t in inputs):  # e.g. a host index into a device tensor
            ops.transfers[ops.current] += 1
            ops._sync(f"{name} with a host tensor")
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ops.mark(t)
        if name in SYNCING_OPS or _sizes_from_values(name, args, kwargs):
            ops._sync(name)
        ops.dispatches[ops.current] += 1
        if name not in METADATA_OPS:
            ops.launches[ops.current] += 1
            ops.launch_names[(ops.current, name)] += 1
            if name in SHAPED_OPS or "attention" in name:
                ops.shapes.add((name, tuple(tuple(t.shape) for t in inputs)))
        return out


class _Functions(TorchFunctionMode):
    """Transfers to the device and host reads of device tensors (calls no dispatch mode sees as such on the CPU)."""

    def __init__(self, ops: DeviceOps) -> None:
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ops = self.ops
        name = getattr(func, "__name__", "")
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        to_device = name in ("to", "cuda") and source is not None and _names_a_device(args[1:], kwargs)
        if to_device and not ops.on_device(source):
            out = func(*args, **kwargs)
            out = out.clone() if out is source else out  # a new tensor, as a real transfer makes
            ops.mark(out)
            ops.transfers[ops.current] += 1
            if not kwargs.get("non_blocking", False):  # non-blocking from pinned memory on CUDA: no wait
                ops._sync("host-to-device copy")
            return out
        if name in HOST_READS and ops.on_device(source):
            ops._sync(name)
            out = func(*args, **kwargs)
            out = out.clone() if out is source else out  # a host copy (on the CPU .cpu() returns its source)
            if isinstance(out, torch.Tensor):
                ops.unmark(out)
            return out
        out = func(*args, **kwargs)
        if source is None and "device" in kwargs and isinstance(out, torch.Tensor):  # made there: torch.zeros(...,
            ops.mark(out)  # device=d); host tensors are made without naming a device
        return out


def _sizes_from_values(name: str, args, kwargs) -> bool:
    """Whether this call's output size is read from tensor values: boolean indexing, or repeat_interleave of a
    repeats tensor without output_size."""
    if name in BOOL_INDEXING_OPS:
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return (name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) > 0
            and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point())


def _names_a_device(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args)


def count_syncs(fn, device_tensors: list[torch.Tensor]) -> int:
    """How many times fn() makes the host wait for the device: on CUDA what torch's sync debug mode reports (the
    real thing), elsewhere DeviceOps' count with `device_tensors` as the device's tensors."""
    if device_tensors and device_tensors[0].device.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchronizing" in str(w.message) for w in caught)
    with DeviceOps(device_tensors) as ops:
        fn()
    return ops.totals()["syncs"]
