"""The fast engine's own copy of the policy in its sampling dtype (rollout.engine_options.weights_dtype, e.g.
bfloat16 for an fp32-master policy): made once, refreshed in place after each update, so that what reads its
tensors (the decode step's captured CUDA graphs) reads the new weights at the addresses it captured."""

from __future__ import annotations

import copy
from typing import Any

import torch

from podsrl.errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def compute_copy(model: torch.nn.Module, dtype: torch.dtype | str | None) -> torch.nn.Module | None:
    """A copy of `model` whose parameters are in `dtype`, for sampling (None when they already are, or no dtype).
    Each parameter is cast straight into the copy (the model is never duplicated in its own dtype); buffers (the
    rotary frequencies) are copied as they are, as from_pretrained keeps them in float32 in any dtype."""
    if isinstance(dtype, str):  # as written in a config file
        dtype = getattr(torch, dtype, None) if dtype in DTYPE_NAMES else None
        if dtype is None:
            raise ConfigError(f"rollout.engine_options.weights_dtype: one of {', '.join(DTYPE_NAMES)}")
    if dtype is None or all(p.dtype == dtype for p in model.parameters()):
        return None
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:  # tied weights stay tied
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
    return copy.deepcopy(model, memo)


def refresh_copy(copy_: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copies `model`'s parameters into the copy's, in place, by name (rounded to the copy's dtype): one foreach
    copy (on CUDA a few multi-tensor kernels, not a launch per parameter)."""
    sources = dict(model.named_parameters())
    targets = list(copy_.named_parameters())
    with torch.no_grad():
        torch._foreach_copy_([p for _, p in targets], [sources[name] for name, _ in targets])
