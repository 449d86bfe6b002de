"""The pointwise parts of the Llama-family layer (podsrl/models/llama.py): RMSNorm, the rotary embedding and the SwiGLU
gating as plain ops for decoding, and as autograd functions for the update that do in a few passes what autograd's
decomposition does in many.

On CPU the update's non-matmul time is a count of passes over [tokens, width] tensors (each ~40-300 us at a
thousand tokens), not their arithmetic, and autograd's backward of slicing, `cat` and fancy indexing adds passes of
its own: a zero-filled full-size gradient per slice, a sorting scatter-add per index. Each function here has the
maths of the code it replaces (the tests compare the whole update with the plain path) with fewer passes:
- `rms_norm`: Llama/Qwen2/Qwen3/Mistral RMSNorm keeping its normalised input for a 7-pass backward (autograd's
  decomposition: 8 passes forward, ~15 backward);
- `rotate_qkv`: the rotary embedding of the queries and keys of a fused q/k/v projection in full-width passes, its
  backward writing one gradient buffer (no zero-filled slice gradients);
- `gather_slots` / `packed_order`: tokens into attention blocks and back, each backward one gather or copy, using
  that every token has exactly one home slot and padding slots get no gradient (no scatter-add);
- `swiglu`: silu(gate) * up of the fused gate/up projection, its backward writing both halves' gradients into one
  buffer (autograd's chunk backward concatenates them: one more pass over [tokens, 2 x intermediate]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# transformers' RMSNorm classes whose forward is weight * (x * rsqrt(mean(x^2) + variance_epsilon)), in float32
PLAIN_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def float32_rms_norm(module: torch.nn.Module) -> bool:
    """A plain RMSNorm with float32 weights: on float32 inputs its maths is F.rms_norm's (same bits). In other dtypes
    the module rounds before the weight multiply, so callers run the module there."""
    return type(module).__name__ in PLAIN_RMS_NORMS and module.weight.dtype == torch.float32


def signed_sin(sin: Tensor) -> Tensor:
    """sin with its first half negated: rotate_half(x) sin = roll(x, d / 2) signed_sin, product by product."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: Tensor, cos: Tensor, signed: Tensor) -> Tensor:
    """The rotary embedding as transformers applies it to these models (x cos + rotate_half(x) sin, rotate_half(x) =
    (-x2, x1)), the same bits in four ops instead of seven (negating is exact); `signed` = signed_sin(sin)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed


def rotate_fused(qkv: Tensor, cos: Tensor, signed: Tensor, heads: int, kv_heads: int,
                 fma: bool = False) -> tuple[Tensor, Tensor]:
    """[B, heads + 2 kv_heads, W, d] projections (heads first, as the decode step runs) -> rotated q [B, heads, W, d]
    and the rotated keys stacked over the values, [B, 2 kv_heads, W, d] (one tensor: the KV cache stores them in one
    write). With cos/signed over every head ([B, heads + 2 kv_heads, W, d], the value heads' cos 1 and sin 0: the
    decode step's `DecodeStack.head_tables`) the whole tensor turns at once, the values unchanged to the bit
    (v * 1 + roll(v) * 0); `fma`: its sum as one addcmul (three ops, not four; rounded once, so not transformers'
    bits: for a path whose attention kernel differs anyway). With tables broadcast over the heads ([B, 1, W, d], a
    prefill) queries and keys turn by `rotate` and the values join them (`rotate_qkv` is the same, token-major with
    its own backward)."""
    if cos.shape[1] == qkv.shape[1]:
        turned = qkv.roll(qkv.shape[-1] // 2, -1)
        rotated = torch.addcmul(qkv * cos, turned, signed) if fma else qkv * cos + turned * signed
        return rotated[:, :heads], rotated[:, heads:]
    qk, v = qkv.split_with_sizes((heads + kv_heads, kv_heads), dim=1)
    q, k = rotate(qk, cos, signed).split_with_sizes((heads, kv_heads), dim=1)
    return q, torch.cat((k, v), dim=1)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        normed = x * rstd
        ctx.save_for_backward(normed, weight, rstd)
        return normed * weight

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        normed, weight, rstd = ctx.saved_tensors
        d_weight = (grad * normed).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        d_normed = grad * weight
        # d x = rstd * (d_normed - normed * mean(d_normed * normed))
        dot = (d_normed * normed).mean(-1, keepdim=True)
        return d_normed.sub_(normed * dot).mul_(rstd), d_weight, None


def rms_norm(module: torch.nn.Module, x: Tensor) -> Tensor:
    """`module(x)` for a float32 RMSNorm of the Llama family (any other norm or dtype: the module itself)."""
    if not float32_rms_norm(module) or x.dtype != torch.float32:
        return module(x)
    return _RMSNorm.apply(x, module.weight, module.variance_epsilon)


class _RotateQKV(torch.autograd.Function):
    """x cos + rotate_half(x) sin = x cos + swap_halves(x) sin', sin' = (-sin1, sin2) (`rotate`): full-width
    passes over queries and keys together, instead of half-width strided ones per tensor."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, signed: Tensor, heads: int, kv_heads: int):  # type: ignore[override]
        rotated = rotate(qkv[:, : heads + kv_heads], cos, signed)
        ctx.save_for_backward(cos, signed)
        ctx.heads, ctx.kv_heads = heads, kv_heads
        return rotated[:, :heads], rotated[:, heads:], qkv[:, heads + kv_heads :].contiguous()

    @staticmethod
    def backward(ctx, d_q: Tensor | None, d_k: Tensor | None, d_v: Tensor | None):  # type: ignore[override]
        cos, signed = ctx.saved_tensors
        h, kv = ctx.heads, ctx.kv_heads
        ref = next(g for g in (d_q, d_k, d_v) if g is not None)
        grad = ref.new_empty(ref.shape[0], h + 2 * kv, ref.shape[-1])
        for g, part in ((d_q, grad[:, :h]), (d_k, grad[:, h : h + kv]), (d_v, grad[:, h + kv :])):
            if g is None:
                part.zero_()
            else:
                part.copy_(g)
        # the transpose of the rotation: g cos + swap_halves(g sin') (swapping halves is its own inverse)
        d_qk = grad[:, : h + kv]
        swapped = (d_qk * signed).roll(d_qk.shape[-1] // 2, -1)
        torch.addcmul(swapped, d_qk, cos, out=d_qk)
        return grad, None, None, None, None


def rotate_qkv(qkv: Tensor, cos: Tensor, signed: Tensor, heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """`rotate_fused` with its own backward: [N, heads + 2 kv_heads, d] projections -> rotated queries [N, heads, d],
    rotated keys and values [N, kv_heads, d]; cos and signed = signed_sin(sin) [N, 1, d]. The rotation is
    transformers' apply_rotary_pos_emb (x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1))."""
    return _RotateQKV.apply(qkv, cos, signed, heads, kv_heads)


class _GatherSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, slots: Tensor, home: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(home)
        return x.index_select(0, slots)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (home,) = ctx.saved_tensors
        return grad.index_select(0, home), None, None


class _PackedOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, home: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(home)
        ctx.slots = y.shape[0]
        return y.index_select(0, home)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (home,) = ctx.saved_tensors
        return grad.new_zeros(ctx.slots, *grad.shape[1:]).index_copy_(0, home, grad), None


def gather_slots(x: Tensor, slots: Tensor, home: Tensor) -> Tensor:
    """x[slots]: [N, ...] packed tokens -> [S, ...] attention slots. `home` [N] is each token's own slot among them;
    the other slots (padding) repeat a token, but no real output reads them, so the gradient of x is the home
    slots' gradient, gathered."""
    return _GatherSlots.apply(x, slots, home)


def packed_order(y: Tensor, home: Tensor) -> Tensor:
    """y[home]: [S, ...] attention outputs of all slots -> [N, ...] packed order; padding slots get 0 gradient."""
    return _PackedOrder.apply(y, home)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:  # type: ignore[override]
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(gate_up, act)
        return act * up

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        gate_up, act = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        d_gate_up = torch.empty_like(gate_up)
        d_gate, d_up = d_gate_up.chunk(2, dim=-1)
        torch.mul(grad, act, out=d_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        return d_gate_up


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) * up, gate and up the two halves of the last dimension (a fused gate/up projection's output)."""
    return _SwiGLU.apply(gate_up)
