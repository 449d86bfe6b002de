"""The shared-prompt update's autograd functions: each equals the code it replaces, forward and backward
(gradcheck in float64; against transformers' modules in float32)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from podsrl.models import kernels
from podsrl.models.kernels import gather_slots, packed_order, rms_norm, rotate_qkv, signed_sin


def rotary_tables(n: int, dim: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(n) % 7
    freqs = positions[:, None].double() / 10000 ** (torch.arange(0, dim, 2).double() / dim)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def test_rms_norm_equals_the_module_and_its_gradient():
    norm = Qwen2RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 3, 16)
    outs = []
    for f in (norm, lambda t: rms_norm(norm, t)):
        norm.weight.grad = None
        leaf = x.clone().requires_grad_()
        y = f(leaf)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        outs.append((y.detach(), leaf.grad, norm.weight.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    weight = torch.rand(16, dtype=torch.float64, requires_grad=True)
    leaf = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, w: kernels._RMSNorm.apply(t, w, 1e-6), (leaf, weight))


def test_rms_norm_leaves_other_norms_and_dtypes_to_the_module():
    layer_norm = torch.nn.LayerNorm(8)
    x = torch.randn(3, 8)
    assert torch.equal(rms_norm(layer_norm, x), layer_norm(x))
    norm = Qwen2RMSNorm(8).to(torch.bfloat16)
    assert torch.equal(rms_norm(norm, x.bfloat16()), norm(x.bfloat16()))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_rotate_qkv_equals_apply_rotary_pos_emb(heads, kv_heads):
    n, dim = 9, 8
    cos, sin = rotary_tables(n, dim)
    qkv = torch.randn(n, heads + 2 * kv_heads, dim)
    q, k = apply_rotary_pos_emb(qkv[None, :, :heads], qkv[None, :, heads : heads + kv_heads], cos[None], sin[None],
                                unsqueeze_dim=2)
    rq, rk, rv = rotate_qkv(qkv, cos[:, None], signed_sin(sin[:, None]), heads, kv_heads)
    torch.testing.assert_close(rq, q[0])
    torch.testing.assert_close(rk, k[0])
    assert torch.equal(rv, qkv[:, heads + kv_heads :])
    cos64, sin64 = rotary_tables(n, dim, torch.float64)
    leaf = torch.randn(n, heads + 2 * kv_heads, dim, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rotate_qkv(t, cos64[:, None], signed_sin(sin64[:, None]), heads, kv_heads), leaf)
    # an output the loss does not use (None gradient) gets a zero gradient
    leaf.grad = None
    rotate_qkv(leaf, cos64[:, None], signed_sin(sin64[:, None]), heads, kv_heads)[0].sum().backward()
    assert torch.all(leaf.grad[:, heads:] == 0) and leaf.grad[:, :heads].abs().sum() > 0


def test_slot_gather_and_packed_order_give_the_home_slots_gradient():
    # 5 tokens in 7 slots: slots 2 and 6 are padding repeating tokens 1 and 4
    slots, home = torch.tensor([0, 1, 1, 2, 3, 4, 4]), torch.tensor([0, 1, 3, 4, 5])
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = gather_slots(x, slots, home)
    assert torch.equal(y, x[slots])
    weights = torch.randn(7, 3, dtype=torch.float64)
    weights[[2, 6]] = 0  # no real output reads a padding slot
    (y * weights).sum().backward()
    reference = torch.zeros(5, 3, dtype=torch.float64).index_add_(0, slots, weights)
    torch.testing.assert_close(x.grad, reference)
    out = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    packed = packed_order(out, home)
    assert torch.equal(packed, out[home])
    packed.backward(torch.ones_like(packed))
    assert torch.equal(out.grad.sum(1) != 0, torch.tensor([True, True, False, True, True, True, False]))
