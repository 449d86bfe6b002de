"""Sampled-token log-probs and full-vocabulary entropy from logits, chunked over tokens.

The one implementation of both statistics (the update's hot path and DynaMO's entropy use it). Memory: the
float32 softmax of at most `chunk` tokens exists at a time, in the forward and in the backward; the backward
recomputes each chunk's logits instead of keeping a [tokens, vocab] float32 tensor alive for autograd (with a 150k
vocabulary that tensor is the update's memory peak). Two entry points:
- `token_logprobs_and_entropy(logits, ...)`: from logits the model already produced (the plain path);
- `head_logprobs_and_entropy(hidden, weight, bias, ...)`: from final hidden states and the output layer, so no
  logits tensor ever exists beyond one chunk (the shared-prompt path); the backward redoes one chunk's matmul.

Entropy is NaN-safe where a logit is -inf: such a token has p = 0 and contributes 0 (and 0 gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK = 1024


def _stats(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob of targets, entropy, logsumexp) of [n, V] scaled logits in a float dtype of >= 32 bits."""
    lse = torch.logsumexp(z, dim=-1)
    logp = z - lse[:, None]
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros((), dtype=z.dtype, device=z.device)).sum(-1)
    return z.gather(-1, targets[:, None])[:, 0] - lse, entropy, lse


def _grad_z(z: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, g_logp: Tensor | None,
            g_entropy: Tensor | None) -> Tensor:
    """d(loss)/dz of one chunk: dlogp_t/dz = onehot(t) - p and dH/dz = -p (log p + H), p = 0 terms exactly 0."""
    logp = z - lse[:, None]
    p = logp.exp()
    grad = torch.zeros_like(z)
    if g_entropy is not None:
        inner = torch.where(p > 0, p * (logp + entropy[:, None]), torch.zeros((), dtype=z.dtype, device=z.device))
        grad -= g_entropy[:, None].to(z.dtype) * inner
    if g_logp is not None:
        g = g_logp[:, None].to(z.dtype)
        grad -= g * p
        grad.scatter_add_(-1, targets[:, None], g)
    return grad


def _float(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk: int):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        logp, ent, lse = [], [], []
        for z, t in zip(logits.split(chunk), targets.split(chunk)):
            a, b, c = _stats(_float(z) / temperature, t)
            logp.append(a)
            ent.append(b)
            lse.append(c)
        logp_t, entropy, lse_t = torch.cat(logp), torch.cat(ent), torch.cat(lse)
        ctx.save_for_backward(logits, targets, lse_t, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp_t, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):  # type: ignore[override]
        logits, targets, lse, entropy = ctx.saved_tensors
        if g_logp is None and g_entropy is None:
            return None, None, None, None
        out = torch.empty_like(logits)
        c, temp = ctx.chunk, ctx.temperature
        for start in range(0, logits.shape[0], c):
            s = slice(start, start + c)
            grad = _grad_z(_float(logits[s]) / temp, targets[s], lse[s], entropy[s],
                           None if g_logp is None else g_logp[s], None if g_entropy is None else g_entropy[s])
            out[s] = grad / temp
        return out, None, None, None


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,  # type: ignore[override]
                temperature: float, chunk: int):
        ctx.set_materialize_grads(False)
        logp, ent, lse = [], [], []
        for h, t in zip(hidden.split(chunk), targets.split(chunk)):
            a, b, c = _stats(_float(torch.nn.functional.linear(h, weight, bias)) / temperature, t)
            logp.append(a)
            ent.append(b)
            lse.append(c)
        logp_t, entropy, lse_t = torch.cat(logp), torch.cat(ent), torch.cat(lse)
        ctx.save_for_backward(hidden, weight, bias, targets, lse_t, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp_t, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):  # type: ignore[override]
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros_like(weight) if need_w else None
        d_bias = torch.zeros_like(bias) if need_b and bias is not None else None
        c, temp = ctx.chunk, ctx.temperature
        for start in range(0, hidden.shape[0], c):
            s = slice(start, start + c)
            h = hidden[s]
            z = _float(torch.nn.functional.linear(h, weight, bias)) / temp
            grad = _grad_z(z, targets[s], lse[s], entropy[s], None if g_logp is None else g_logp[s],
                           None if g_entropy is None else g_entropy[s])
            grad = (grad / temp).to(hidden.dtype)
            if d_hidden is not None:
                d_hidden[s] = grad @ weight
            if d_weight is not None:
                d_weight.addmm_(grad.t(), h)
            if d_bias is not None:
                d_bias += grad.sum(0)
        return d_hidden, d_weight, d_bias, None, None, None


def token_logprobs_and_entropy(logits: Tensor, tokens: Tensor, temperature: float = 1.0,
                               chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """[..., V] logits -> ([...] log-prob of `tokens` under softmax(logits / T), [...] entropy), float32 or wider."""
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] == 0:
        empty = flat.new_zeros(lead, dtype=torch.promote_types(flat.dtype, torch.float32))
        return empty, empty.clone()
    logp, entropy = _FromLogits.apply(flat, tokens.reshape(-1), float(temperature), max(1, int(chunk)))
    return logp.view(lead), entropy.view(lead)


def head_logprobs_and_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,
                              temperature: float = 1.0, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """[N, D] final hidden states and the output layer -> ([N] log-probs of `tokens`, [N] entropies)."""
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, empty.clone()
    return _FromHidden.apply(hidden, weight, bias, tokens, float(temperature), max(1, int(chunk)))


def token_entropy(logits: Tensor, chunk_size: int | None = 256) -> Tensor:
    """[B, T, V] logits -> [B, T] full-vocabulary entropy (float32 or wider); differentiable."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits.shape)}")
    tokens = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    chunk = chunk_size if chunk_size else max(1, logits.shape[0] * logits.shape[1])
    return token_logprobs_and_entropy(logits, tokens, 1.0, chunk)[1]
