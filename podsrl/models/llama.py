"""The one implementation of a Llama/Mistral/Qwen2/Qwen3 decoder layer that podsrl runs itself, for the fast
engine's decode step (podsrl/models/decode.py) and the update's packed shared-prompt forward (podsrl/models/packed.py).

A layer runs from its own submodules' weights: RMSNorm, q/k/v as one matmul, the rotary embedding by a roll, the
gated MLP with gate/up as one matmul. What differs between the two callers is a parameter, not a second copy:
- `attend`: how attention reads keys and values (decode: over the static KV cache; training: the packed prompt and
  completion blocks);
- `autograd`: the update's pointwise parts run as the autograd functions of kernels.py (fewer passes forward and
  backward), the decode step's as plain ops that give transformers' bits with the fewest dispatches.
Hidden states are [..., D] (decode [B, W, D], training [N, D]); q/k/v come out as attention reads them: decode
heads first [B, heads, W, d] (what the KV cache stores, no transpose per tensor), training token-major [N, heads, d].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from podsrl.models.kernels import float32_rms_norm, rms_norm, rotate, rotate_fused, rotate_qkv, swiglu

SILU_TYPES = ("SiLU", "SiLUActivation")  # activation modules that are F.silu (transformers' or torch's)


def norm_function(norm: torch.nn.Module, autograd: bool = False) -> Callable[[Tensor], Tensor]:
    """`norm` as a function of x. With autograd, kernels.rms_norm (its own backward). Else a plain RMSNorm with
    float32 weights, on float32 x, as F.rms_norm with its arguments bound: the same bits in one call from Python
    instead of seven, with no parameter lookups."""
    if autograd:
        return functools.partial(rms_norm, norm)
    if not float32_rms_norm(norm):
        return norm
    weight, shape, eps = norm.weight, norm.weight.shape, norm.variance_epsilon
    return lambda x: F.rms_norm(x, shape, weight, eps) if x.dtype == torch.float32 else norm(x)


def fused_qkv(attn: torch.nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """The q/k/v projections' weights (and biases) concatenated, for one matmul instead of three; None when they are
    not all plain Linear (LoRA-wrapped) or only some have a bias. Built on each call (the weights change in place),
    unless share_fused_storage made them views of one tensor: then that tensor, no copy."""
    if not _qkv_fusable(attn):
        return None
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    bias = None if attn.q_proj.bias is None else _joined([m.bias for m in projections])
    return _joined([m.weight for m in projections]), bias


def fused_gate_up(mlp: torch.nn.Module) -> Tensor | None:
    """The gate and up projections' weights concatenated, for one matmul instead of two; None unless the MLP is the
    gated down(act_fn(gate(x)) * up(x)) of plain Linear layers, gate and up without bias. Built on each call (the
    weights change in place), unless share_fused_storage made them views of one tensor: then that tensor."""
    return _joined([mlp.gate_proj.weight, mlp.up_proj.weight]) if _gate_up_fusable(mlp) else None


def share_fused_storage(layers: list[torch.nn.Module]) -> None:
    """For weights that are only sampled from (the fast engine's own copy in the compute dtype): re-homes each layer's
    q/k/v weights and biases and its gate/up weights as consecutive rows of one tensor each. fused_qkv and
    fused_gate_up then return those tensors instead of concatenated copies (2/3 of the weights' bytes saved, kept
    through the update too), and an in-place refresh of the projections reaches them. The values do not change."""
    with torch.no_grad():
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if _qkv_fusable(attn):
                projections = (attn.q_proj, attn.k_proj, attn.v_proj)
                for name in ("weight", "bias") if attn.q_proj.bias is not None else ("weight",):
                    _rehome(projections, name)
            if _gate_up_fusable(mlp):
                _rehome((mlp.gate_proj, mlp.up_proj), "weight")


def _qkv_fusable(attn: torch.nn.Module) -> bool:
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    return all(type(m) is torch.nn.Linear for m in projections) and len({m.bias is None for m in projections}) == 1


def _gate_up_fusable(mlp: torch.nn.Module) -> bool:
    gated = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (all(type(m) is torch.nn.Linear for m in gated) and hasattr(mlp, "act_fn")
            and gated[0].bias is None and gated[1].bias is None)


def _rehome(modules, name: str) -> None:
    tensors = [getattr(m, name) for m in modules]
    joined, start = torch.cat([t.detach() for t in tensors]), 0
    for module, t in zip(modules, tensors):
        setattr(module, name, torch.nn.Parameter(joined[start:start + t.shape[0]], requires_grad=t.requires_grad))
        start += t.shape[0]


def _joined(tensors: list[Tensor]) -> Tensor:
    """The tensors concatenated along rows: a view when they already are consecutive rows of one storage (and need
    no gradient), else a new tensor."""
    first, offset = tensors[0], tensors[0].storage_offset()
    for t in tensors:
        if (t.requires_grad or not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset):
            return torch.cat(tensors)
        offset += t.numel()
    return first.detach().as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def _shares_storage(fused: Tensor, first: Tensor) -> bool:
    return fused.data_ptr() == first.data_ptr()


class LayerPlan(NamedTuple):
    """One decoder layer bound for a forward: its parts as callables and fused weights, so the layer then indexes a
    tuple instead of looking up submodules and parameters (~1 us each while decoding, a third of a small op)."""

    index: int  # the layer's place in the stack (its KV cache layer)
    heads_first: bool  # q/k/v as [B, heads, W, d] (decode) instead of [..., heads, d]
    attn: torch.nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    input_norm: Callable[[Tensor], Tensor]
    qkv: tuple[Tensor, Tensor | None] | None  # q/k/v weight and bias concatenated; None: one by one
    rotate_qkv: Callable[..., tuple[Tensor, ...]]  # rotate_fused, or its autograd function
    qk_norms: tuple[Callable, Callable] | None  # Qwen3's per-head q and k norms
    o_proj: torch.nn.Module
    post_norm: Callable[[Tensor], Tensor]
    mlp: Callable[[Tensor], Tensor]
    gate_up: Tensor | None = None  # the fused gate/up weight `mlp` reads (None: the MLP runs as its module)
    # the residual adds inside the o_proj and down matmuls (addmm: one op, one rounding; the decode step off the CPU)
    fold_residual: bool = False


def layer_plan(layer: torch.nn.Module, index: int, config, autograd: bool, heads_first: bool = False,
               cast: torch.dtype | None = None) -> LayerPlan:
    """The layer's plan: q/k/v and gate/up each one matmul (instead of three and two) where they are plain Linear
    (not LoRA-wrapped) and the MLP is the gated down(act(gate(x)) * up(x)); `cast`: those fused weights made in that
    dtype (autocast's, so no matmul casts them again). Bind it where the weights are what the forward must use (under
    FSDP2, inside the layer's own call, while its parameters are gathered)."""
    attn = layer.self_attn
    qk_norms, gate_up, qkv = None, fused_gate_up(layer.mlp), fused_qkv(attn)
    if cast is not None:
        gate_up = None if gate_up is None else gate_up.to(cast)
        qkv = None if qkv is None else (qkv[0].to(cast), None if qkv[1] is None else qkv[1].to(cast))
    if hasattr(attn, "q_norm"):
        qk_norms = (norm_function(attn.q_norm, autograd), norm_function(attn.k_norm, autograd))
    return LayerPlan(
        index=index,
        heads_first=heads_first,
        attn=attn,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim,
        scaling=attn.scaling,
        input_norm=norm_function(layer.input_layernorm, autograd),
        qkv=qkv,
        rotate_qkv=rotate_qkv if autograd else rotate_fused,
        qk_norms=qk_norms,
        o_proj=attn.o_proj,
        post_norm=norm_function(layer.post_attention_layernorm, autograd),
        mlp=_mlp_function(layer.mlp, gate_up, autograd),
        gate_up=gate_up,
    )


def refresh_fused(plan: LayerPlan, layer: torch.nn.Module) -> None:
    """Copies the layer's current q/k/v and gate/up weights into the plan's fused ones in place: a plan kept across
    optimiser steps (the decode step's, which a CUDA graph reads at fixed addresses) computes with today's weights.
    Nothing to copy where the fused tensor is the projections' own storage (share_fused_storage)."""
    attn = layer.self_attn
    if plan.qkv is not None and not _shares_storage(plan.qkv[0], attn.q_proj.weight):
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        torch.cat([m.weight for m in projections], out=plan.qkv[0])
        if plan.qkv[1] is not None:
            torch.cat([m.bias for m in projections], out=plan.qkv[1])
    if plan.gate_up is not None and not _shares_storage(plan.gate_up, layer.mlp.gate_proj.weight):
        torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight], out=plan.gate_up)


def _mlp_function(mlp: torch.nn.Module, gate_up: Tensor | None, autograd: bool) -> Callable[[Tensor], Tensor]:
    """down(act(gate(x)) * up(x)) with gate/up as one matmul (`gate_up`, from fused_gate_up), and with autograd a
    SiLU gating as kernels.swiglu; the MLP module itself when its weights cannot be fused."""
    if gate_up is None:
        return mlp
    down, act = mlp.down_proj, mlp.act_fn
    if autograd and type(act).__name__ in SILU_TYPES:
        return lambda x: down(swiglu(F.linear(x, gate_up)))

    def gated(x: Tensor, residual: Tensor | None = None) -> Tensor:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return down(act(gate) * up) if residual is None else add_projection(residual, act(gate) * up, down)

    return gated


def project_qkv(plan: LayerPlan, x: Tensor, cos: Tensor, signed: Tensor) -> tuple[Tensor, ...]:
    """Rotated queries, rotated keys and values of normed hidden states x [..., D]: (q, k, v) [..., heads, d], or
    with `heads_first` (q [B, heads, W, d], keys stacked over values [B, 2 kv_heads, W, d]: what the KV cache stores
    in one write); cos and signed sin broadcast over the heads ([..., 1, d] or [B, 1, W, d]), or with `heads_first`
    given per head (kernels.rotate_fused)."""
    shape = (*x.shape[:-1], -1, plan.head_dim)
    if plan.qkv is not None:
        qkv = F.linear(x, *plan.qkv).view(shape)
        if plan.heads_first:
            qkv = qkv.transpose(1, 2)
        if plan.qk_norms is None:
            return plan.rotate_qkv(qkv, cos, signed, plan.heads, plan.kv_heads)
        q, k, v = qkv.split_with_sizes((plan.heads, plan.kv_heads, plan.kv_heads), dim=-3 if plan.heads_first else -2)
    else:  # wrapped projections (LoRA) run as their modules
        attn = plan.attn
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if plan.heads_first:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if plan.qk_norms is not None:  # Qwen3: per-head RMSNorm before the rotation
        q, k = plan.qk_norms[0](q), plan.qk_norms[1](k)
    if plan.heads_first:
        cos, signed = cos[:, :1], signed[:, :1]  # the query heads' tables hold for every rotated head
        return rotate(q, cos, signed), torch.cat((rotate(k, cos, signed), v), dim=1)
    return rotate(q, cos, signed), rotate(k, cos, signed), v


# attention as a caller reads it: (plan, what project_qkv returns) -> [..., H * d] like the hidden states
Attend = Callable[..., Tensor]


def decoder_layer(plan: LayerPlan, hidden: Tensor, cos: Tensor, signed: Tensor, attend: Attend,
                  keep: Tensor | None = None) -> Tensor:
    """One pre-norm decoder layer: hidden + attention, then + MLP. `keep` (index of positions): only those go on
    through the MLP (the last layer of a forward whose other positions nobody reads)."""
    attended = attend(plan, *project_qkv(plan, plan.input_norm(hidden), cos, signed))
    hidden = add_projection(hidden, attended, plan.o_proj) if plan.fold_residual else hidden + plan.o_proj(attended)
    if keep is not None:
        hidden = hidden[keep]
    if plan.fold_residual and plan.gate_up is not None:
        return plan.mlp(plan.post_norm(hidden), hidden)
    return hidden + plan.mlp(plan.post_norm(hidden))


def add_projection(residual: Tensor, x: Tensor, linear: torch.nn.Module) -> Tensor:
    """residual + linear(x) as one addmm where `linear` is a plain Linear without bias (the sum rounded once, inside
    the matmul), else as the two ops."""
    if type(linear) is not torch.nn.Linear or linear.bias is not None:
        return residual + linear(x)
    return torch.addmm(residual.flatten(0, -2), x.flatten(0, -2), linear.weight.t()).view_as(residual)
