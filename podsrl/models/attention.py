"""Attention as plain grouped matmuls, for the fast engine's decode loop and the update's shared-prompt path.

On CPU, `scaled_dot_product_attention` dispatches to a flash kernel whose per-call cost dwarfs the work at the small
query/key lengths of RL rollouts (one query per row while decoding, short length buckets in the update): at 256
decode rows it took ~2.7 ms a call, several times the step's matmuls, and its backward was ~10% of an update step
of the tiny model. Two batched matmuls and a softmax do the same maths; grouped-query heads read their key/value
head through a reshape instead of a repeated copy. Off the CPU the fused kernels win and, unlike these matmuls,
never hold the [queries, keys] scores of long sequences, so there `grouped_attention` calls
`scaled_dot_product_attention` (same maths, same handling of fully blocked queries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """softmax(q k^T * scaling, blocked keys excluded) v for q [B, H, Q, d] and keys/values [B, Hkv, K, d], query
    head h reading key/value head h // (H / Hkv) as transformers' repeat_kv does; blocked [B, 1, Q, K] bool. A
    query with every key blocked (left padding) gets a uniform average instead of NaN, as eager attention does;
    its output is never read by a real position. Softmax in float32 at least, as the eager implementation."""
    if q.device.type != "cpu":
        return fused_attention(q, keys, values, blocked, scaling)
    batch, heads, width, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    scores = torch.matmul(q.reshape(batch, kv_heads, groups * width, dim), keys.transpose(-1, -2)) * scaling
    scores = scores.view(batch, kv_heads, groups, width, length)
    scores = scores.masked_fill(blocked[:, :, None], torch.finfo(scores.dtype).min)
    probs = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(values.dtype)
    return torch.matmul(probs.view(batch, kv_heads, groups * width, length), values).view(batch, heads, width, dim)


def fused_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """`grouped_attention` through scaled_dot_product_attention. A fully blocked query gets the uniform average
    of the matmul version (its query zeroed, every key allowed) instead of NaN, which 0-weights would carry on."""
    lost = blocked.all(dim=-1, keepdim=True)  # [B, 1, Q, 1]
    q = q.masked_fill(lost, 0.0)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=~blocked | lost, scale=scaling,
                                          enable_gqa=q.shape[1] != keys.shape[1])


def decode_bias(mask: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """decode_attention's bias [B * kv_heads, 1, K] from the bool [B, 1, 1, K] 'may attend' mask: 0 where allowed,
    finfo.min where blocked."""
    bias = torch.full((mask.shape[0], kv_heads, mask.shape[-1]), torch.finfo(dtype).min, dtype=dtype,
                      device=mask.device)
    return bias.masked_fill_(mask[:, :, 0], 0.0).view(-1, 1, mask.shape[-1])


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """`grouped_attention` for one query per row (q [B, H, 1, d]) on the CPU, the blocked keys given as an additive
    bias [B * Hkv, 1, K] (0 allowed, finfo.min blocked) built once for all layers: scaling and masking in place on
    the scores instead of a masked_fill over a broadcast copy. Same bits as grouped_attention in every dtype (adding
    0 is exact; finfo.min plus a finite score rounds back to finfo.min, so a row with every key blocked still
    averages uniformly, though decoding never makes one: every row attends to its newest key)."""
    batch, heads, _, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    scores = torch.bmm(q.reshape(batch * kv_heads, heads // kv_heads, dim),
                       keys.reshape(batch * kv_heads, length, dim).transpose(1, 2))
    scores = scores.mul_(scaling).add_(bias)
    probs = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(values.dtype)
    return torch.bmm(probs, values.reshape(batch * kv_heads, length, dim)).view(batch, heads, 1, dim)


def sdpa_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fused_decode_attention's additive bias [B, 1, 1, K] from the bool 'may attend' mask [B, 1, 1, K]: 0 where
    allowed, finfo.min where blocked (not -inf: a row with every key blocked, a bucket's padding row, then averages
    uniformly instead of giving NaN). Built once per step for all layers, in the dtype of the queries as SDPA asks."""
    return torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)


def fused_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                           scaling: float) -> torch.Tensor:
    """`grouped_attention` for one query per row (q [B, H, 1, d]) in one scaled_dot_product_attention: a key/value
    head's H / Hkv query heads go in as that head's queries ([B, Hkv, H / Hkv, d]: no GQA expansion of the keys,
    no causal mask), the blocked keys as sdpa_bias's additive bias [B, 1, 1, K] built once per step."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, heads // kv_heads, dim), keys, values,
                                         attn_mask=bias, scale=scaling)
    return out.view(batch, heads, 1, dim)
