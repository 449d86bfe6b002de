"""What the fast engine and the shared-prompt update compute of Llama/Mistral/Qwen2/Qwen3 decoder layers without
calling their modules: RMSNorm as F.rms_norm, q/k/v as one matmul, the rotary embedding by a roll."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# transformers' RMSNorm classes whose forward is weight * (x * rsqrt(mean(x^2) + variance_epsilon)), in float32
PLAIN_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def float32_rms_norm(module: torch.nn.Module) -> bool:
    """A plain RMSNorm with float32 weights: on float32 inputs its maths is F.rms_norm's (same bits). In other dtypes
    the module rounds before the weight multiply, so callers run the module there."""
    return type(module).__name__ in PLAIN_RMS_NORMS and module.weight.dtype == torch.float32


def norm_function(norm: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`norm` as a function of x; a plain RMSNorm with float32 weights, on float32 x, as F.rms_norm with its
    arguments bound: the same bits in one call from Python instead of seven, with no parameter lookups."""
    if not float32_rms_norm(norm):
        return norm
    weight, shape, eps = norm.weight, norm.weight.shape, norm.variance_epsilon
    return lambda x: F.rms_norm(x, shape, weight, eps) if x.dtype == torch.float32 else norm(x)


def fused_qkv(attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The q/k/v projections' weights (and biases) concatenated, for one matmul instead of three; None when they are
    not all plain Linear (LoRA-wrapped) or only some have a bias. Built on each call: the weights change in place."""
    if not _qkv_fusable(attn):
        return None
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    bias = None if attn.q_proj.bias is None else torch.cat([m.bias for m in projections])
    return torch.cat([m.weight for m in projections]), bias


def fused_gate_up(mlp: torch.nn.Module) -> torch.Tensor | None:
    """The gate and up projections' weights concatenated, for one matmul instead of two; None unless the MLP is the
    gated down(act_fn(gate(x)) * up(x)) of plain Linear layers, gate and up without bias. Built on each call: the
    weights change in place."""
    if not _gate_up_fusable(mlp):
        return None
    return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])


def _qkv_fusable(attn: torch.nn.Module) -> bool:
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    return all(type(m) is torch.nn.Linear for m in projections) and len({m.bias is None for m in projections}) == 1


def _gate_up_fusable(mlp: torch.nn.Module) -> bool:
    gated = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (all(type(m) is torch.nn.Linear for m in gated) and hasattr(mlp, "act_fn")
            and gated[0].bias is None and gated[1].bias is None)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) sin = roll(x, d / 2) signed_sin, product by product."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as transformers applies it to these models (x cos + rotate_half(x) sin, rotate_half(x) =
    (-x2, x1)), the same bits in four ops instead of seven (negating is exact); `signed` = signed_sin(sin)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed
