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


def check_precision(cfg) -> None:
    """ConfigError naming the key for a compute dtype that cannot go with the parameter dtype, or (FSDP2) for two
    different values of model.compute_dtype and train.fsdp_param_dtype, which are one setting there. Reads only."""
    params, fsdp = cfg.model.dtype, cfg.train.fsdp_param_dtype
    if cfg.train.strategy == "fsdp" and "auto" not in (cfg.model.compute_dtype, fsdp) and cfg.model.compute_dtype != fsdp:
        raise ConfigError(f"train.fsdp_param_dtype: {fsdp} differs from model.compute_dtype "
                          f"{cfg.model.compute_dtype}; under FSDP2 they are the same setting (the compute dtype): set "
                          "one of them, or both to the same")
    compute = compute_dtype_name(cfg)  # each one of its Literal's names (config.py)
    if compute == "float16":
        raise ConfigError("model.compute_dtype: float16 is refused: podsrl has no loss scaling, so small float16 "
                          "gradients would underflow to zero; use bfloat16")
    if compute == "float32" and params != "float32":
        raise ConfigError(f"model.compute_dtype: float32 compute over {params} weights (model.dtype) gains nothing: "
                          "the weights are already rounded. For float32 master weights with bfloat16 compute set "
                          f"model.dtype=float32 model.compute_dtype=bfloat16; for pure {params} set "
                          f"model.compute_dtype={params} (or auto)")


def compute_dtype_name(cfg) -> str:
    """The configured compute dtype: model.compute_dtype; under FSDP2 (its MixedPrecisionPolicy's param_dtype is the
    compute dtype) an explicit train.fsdp_param_dtype stands for an `auto` model.compute_dtype."""
    if cfg.train.strategy == "fsdp" and cfg.model.compute_dtype == "auto":
        return cfg.train.fsdp_param_dtype
    return cfg.model.compute_dtype


def resolve_compute_dtype(cfg, device: torch.device | str) -> torch.dtype:
    """THE resolution of the compute dtype: the dtype of the forward/backward matmuls on `device` (and of the fast
    engine's sampling copy there). `auto` = bfloat16 on CUDA and float32 elsewhere, never wider than the parameters
    (bfloat16 weights compute in bfloat16)."""
    name, params = compute_dtype_name(cfg), getattr(torch, cfg.model.dtype)
    if name != "auto":
        return getattr(torch, name)
    wanted = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return params if params.itemsize < wanted.itemsize else wanted


def describe_precision(master: torch.dtype, compute: torch.dtype, lora: bool = False) -> str:
    """One line for the log: what is stored in which dtype and what the matmuls run in. With LoRA the adapters and
    their AdamW state are float32 whatever model.dtype (peft keeps them in float32 and casts their input to it,
    autocast aside), over a frozen base in the master dtype with no master copy."""
    name, master_name = str(compute).removeprefix("torch."), str(master).removeprefix("torch.")
    if lora:
        return (f"LoRA: float32 adapters and their optimiser state over a frozen {master_name} base (no float32 "
                f"master copy of it); matmuls in {name}"
                + (" (autocast)" if compute != master else ", the adapters' in float32" if master != torch.float32
                   else ""))
    if master != torch.float32:
        return f"pure {master_name}: weights and optimiser state in {master_name} (no float32 master copy)"
    if compute == master:
        return "float32: weights, optimiser state and compute"
    return f"mixed precision: float32 master weights and optimiser state, {name} compute (autocast)"


def compute_autocast(device: torch.device | str, compute_dtype: torch.dtype,
                     param_dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to `compute_dtype` on `device`; a no-op when it is the parameter dtype (nothing to cast)."""
    if compute_dtype == param_dtype:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=compute_dtype)
