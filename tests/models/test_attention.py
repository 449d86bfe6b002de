"""podsrl/models/attention.py: the CPU matmul attention and the fused kernel used off the CPU agree."""

import torch

from podsrl.models.attention import fused_attention, grouped_attention


def test_grouped_matmul_attention_equals_the_fused_kernel_with_gqa_and_fully_blocked_queries():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 5, 8), torch.randn(3, 2, 7, 8), torch.randn(3, 2, 7, 8)  # 2 query heads per kv head
    blocked = torch.rand(3, 1, 5, 7) < 0.4
    blocked[0, 0, 1] = True  # a query with every key blocked (left padding)
    ours, fused = grouped_attention(q, k, v, blocked, 0.3), fused_attention(q, k, v, blocked, 0.3)
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(ours, fused, rtol=1e-5, atol=1e-6)
    # repeat_kv semantics: query head h reads key/value head h // 2
    reference = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(
        blocked, torch.finfo(q.dtype).min), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_one_query_sdpa_with_a_step_bias_equals_grouped_attention():
    """fused_decode_attention (the decode step off the CPU: a kv head's query heads as its queries, the mask as an
    additive bias built once per step) is grouped_attention; a row with every key blocked (a bucket's padding row)
    averages uniformly instead of giving NaN."""
    from podsrl.models.attention import fused_decode_attention, sdpa_bias

    torch.manual_seed(0)
    q = torch.randn(4, 6, 1, 8)  # 3 query heads per kv head
    buffers = torch.randn(2, 4, 2, 11, 8)  # keys over values, capacity past the 9 read
    keys, values = buffers[0, :, :, :9], buffers[1, :, :, :9]
    allowed = torch.rand(4, 1, 1, 9) < 0.5
    allowed[0], allowed[1] = False, True
    out = fused_decode_attention(q, keys, values, sdpa_bias(allowed, q.dtype), 0.35)
    torch.testing.assert_close(out, grouped_attention(q, keys, values, ~allowed, 0.35), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[0, :, 0], values[0].mean(1).repeat_interleave(3, 0), rtol=1e-5, atol=1e-6)
