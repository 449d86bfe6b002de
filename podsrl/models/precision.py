"""The dtypes a run trains in: parameters and optimiser state in `model.dtype` (the master weights), forward and
backward matmuls in `model.compute_dtype` through autocast.

- float32 masters + bfloat16 compute (`auto` on CUDA): mixed precision as every peer does it; AdamW updates and the
  accumulated gradients stay float32, so small updates are not rounded away.
- float32 + float32 (`auto` on CPU): no autocast at all.
- bfloat16 + bfloat16: pure bfloat16 (weights and optimiser state in bfloat16, no float32 copy), said as such.
Log-probs, entropies and the loss are float32 whatever the compute dtype (podsrl/models/logprobs.py runs its softmax
outside autocast). float16 compute is refused like float16 weights: without loss scaling small float16 gradients
underflow to zero.
"""

from __future__ import annotations

import contextlib

import torch

from podsrl.errors import ConfigError


def check_precision(model_cfg, train_cfg=None) -> None:
    """ConfigError naming the key for a compute dtype that cannot go with the parameter dtype. Under FSDP2 the
    compute dtype is its MixedPrecisionPolicy's param_dtype (`train.fsdp_param_dtype`): the two keys are one
    setting, so an explicit value of either fills the other's `auto` (in place) and two different ones are refused."""
    compute, params = model_cfg.compute_dtype, model_cfg.dtype  # each one of its Literal's names (config.py)
    if compute == "float16":
        raise ConfigError("model.compute_dtype: float16 is refused: podsrl has no loss scaling, so small float16 "
                          "gradients would underflow to zero; use bfloat16")
    if compute == "float32" and params != "float32":
        raise ConfigError(f"model.compute_dtype: float32 compute over {params} weights (model.dtype) gains nothing: "
                          "the weights are already rounded. For float32 master weights with bfloat16 compute set "
                          f"model.dtype=float32 model.compute_dtype=bfloat16; for pure {params} set "
                          f"model.compute_dtype={params} (or auto)")
    if train_cfg is None or train_cfg.strategy != "fsdp":
        return
    fsdp = train_cfg.fsdp_param_dtype
    if "auto" not in (compute, fsdp) and compute != fsdp:
        raise ConfigError(f"train.fsdp_param_dtype: {fsdp} differs from model.compute_dtype {compute}; under FSDP2 "
                          "they are the same setting (the compute dtype): set one of them, or both to the same")
    if fsdp == "auto":
        train_cfg.fsdp_param_dtype = compute
    elif compute == "auto":
        model_cfg.compute_dtype = fsdp
        check_precision(model_cfg)


def resolve_compute_dtype(model_cfg, device: torch.device | str) -> torch.dtype:
    """The dtype of the forward/backward matmuls on `device` (model.compute_dtype over model.dtype weights)."""
    return resolve_dtype_name(model_cfg.compute_dtype, getattr(torch, model_cfg.dtype), device)


def resolve_dtype_name(name: str, param_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """A compute dtype's name as a dtype: `auto` = bfloat16 on CUDA and float32 elsewhere, never wider than the
    parameters (bfloat16 weights compute in bfloat16)."""
    if name != "auto":
        return getattr(torch, name)
    wanted = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return param_dtype if param_dtype.itemsize < wanted.itemsize else wanted


def describe_precision(model_cfg, device: torch.device | str) -> str:
    """One line for the log: what is stored in which dtype and what the matmuls run in. With LoRA the adapters and
    their AdamW state are float32 whatever model.dtype (peft keeps them in float32 and casts their input to it,
    autocast aside), over a frozen base in model.dtype with no master copy."""
    params, compute = getattr(torch, model_cfg.dtype), resolve_compute_dtype(model_cfg, device)
    name = str(compute).removeprefix("torch.")
    if model_cfg.lora_rank > 0:
        return (f"LoRA: float32 adapters and their optimiser state over a frozen {model_cfg.dtype} base (no float32 "
                f"master copy of it); matmuls in {name}"
                + (" (autocast)" if compute != params else ", the adapters' in float32" if params != torch.float32
                   else ""))
    if params != torch.float32:
        return f"pure {model_cfg.dtype}: weights and optimiser state in {model_cfg.dtype} (no float32 master copy)"
    if compute == params:
        return "float32: weights, optimiser state and compute"
    return f"mixed precision: float32 master weights and optimiser state, {name} compute (autocast)"


def compute_autocast(device: torch.device | str, compute_dtype: torch.dtype,
                     param_dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to `compute_dtype` on `device`; a no-op when it is the parameter dtype (nothing to cast)."""
    if compute_dtype == param_dtype:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=compute_dtype)
