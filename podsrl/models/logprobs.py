"""Sampled-token log-probs and full-vocabulary entropy from logits, chunked over tokens.

The one implementation of both statistics (the update's hot path and the token-entropy modulation use it). Memory: the
float32 softmax of at most `chunk` tokens exists at a time, in the forward and in the backward; the backward
recomputes each chunk's logits instead of keeping a [tokens, vocab] float32 tensor alive for autograd (with a 150k
vocabulary that tensor is the update's memory peak). Two entry points:
- `token_logprobs_and_entropy(logits, ...)`: from logits the model already produced (the plain path);
- `head_logprobs_and_entropy(hidden, weight, bias, ...)`: from final hidden states and the output layer, so no
  logits tensor ever exists beyond one chunk (the shared-prompt path); the backward redoes one chunk's matmul.

Under autocast (model.compute_dtype, podsrl/models/precision.py) only the output layer's matmul runs in the compute
dtype; log-softmax, entropy and their gradients are float32 (autocast is turned off around them).

Entropy is NaN-safe where a logit is -inf: such a token has p = 0 and contributes 0 (and 0 gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK = 1024


def _stats_(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob of targets, entropy, logsumexp) of [n, V] scaled logits (float, >= 32 bits); overwrites `z`.

    In place and with one fused reduction for the entropy (H = -sum p log p): these passes over [n, V], not the
    matmuls, were most of the output layer's time on CPU."""
    lse = torch.logsumexp(z, dim=-1)
    target = z.gather(-1, targets[:, None])[:, 0] - lse
    logp = z.sub_(lse[:, None])
    p = torch.exp(logp)
    logp.clamp_(min=torch.finfo(logp.dtype).min)  # -inf -> finite, so p = 0 contributes 0, not NaN
    return target, -torch.einsum("nv,nv->n", p, logp), lse


def _grad_z_(z: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, g_logp: Tensor | None,
             g_entropy: Tensor | None) -> Tensor:
    """d(loss)/dz of one chunk from its recomputed scaled logits (overwritten):
    dlogp_t/dz = onehot(t) - p, dH/dz = -p (log p + H); tokens with p = 0 get exactly 0."""
    logp = z.sub_(lse[:, None])
    p = torch.exp(logp)
    if g_entropy is None:
        grad = p.mul_(-g_logp[:, None].to(p.dtype))
    else:
        grad = logp.clamp_(min=torch.finfo(logp.dtype).min).add_(entropy[:, None])
        grad.mul_(-g_entropy[:, None].to(p.dtype))
        if g_logp is not None:
            grad.sub_(g_logp[:, None].to(p.dtype))
        grad.mul_(p)
    if g_logp is not None:
        grad.scatter_add_(-1, targets[:, None], g_logp[:, None].to(p.dtype))
    return grad


def _float(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scaled(t: Tensor, temperature: float) -> Tensor:
    """A float (>= 32-bit) copy of t / temperature that the caller owns."""
    return _float(t) / temperature if temperature != 1.0 or t.dtype != _float(t).dtype else t.clone()


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk: int):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        logp, ent, lse = [], [], []
        with _no_autocast(logits):
            for z, t in zip(logits.split(chunk), targets.split(chunk)):
                a, b, c = _stats_(_scaled(z, temperature), t)
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
        with _no_autocast(logits):
            for start in range(0, logits.shape[0], c):
                s = slice(start, start + c)
                grad = _grad_z_(_scaled(logits[s], temp), targets[s], lse[s], entropy[s],
                                None if g_logp is None else g_logp[s], None if g_entropy is None else g_entropy[s])
                out[s] = grad.div_(temp)
                del grad  # before the next chunk's are made: one chunk's [c, V] buffers live at a time
        return out, None, None, None


class _FromHidden(torch.autograd.Function):
    """The logits z = h W^T + b come out of the output layer's matmul (under autocast in its dtype, the forward's
    and the backward's recomputed logits alike, so both see the same logits) and are divided by the temperature in
    float32 afterwards, as the sampler and the plain path do: folding 1 / T into h before a bfloat16 matmul rounds
    a different product and shifts the log-probs by a few hundredths of a nat a token at T = 0.7. The backward
    scales the incoming gradients by 1 / T (d(loss)/dz is linear in them), so no pass over [n, V] divides there.
    Gradients accumulate in the parameters' dtype."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,  # type: ignore[override]
                temperature: float, chunk: int):
        ctx.set_materialize_grads(False)
        ctx.compute = _autocast_dtype(hidden)
        logp, ent, lse = [], [], []
        with _no_autocast(hidden):
            w, b = _cast(weight, ctx.compute), _cast(bias, ctx.compute)
            for h, t in zip(hidden.split(chunk), targets.split(chunk)):
                z = _logits(h, w, b, ctx.compute, temperature)
                target, entropy, norm = _stats_(z, t)
                logp.append(target)
                ent.append(entropy)
                lse.append(norm)
                del z  # before the next chunk's logits are made: one [chunk, V] float32 tensor at a time
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
        c, temp, compute = ctx.chunk, ctx.temperature, ctx.compute
        # d(loss)/d(h W^T + b) = d(loss)/dz / T
        g_logp = None if g_logp is None else g_logp / temp
        g_entropy = None if g_entropy is None else g_entropy / temp
        with _no_autocast(hidden):
            w, b = _cast(weight, compute), _cast(bias, compute)
            mixed = compute is not None  # compute-dtype products accumulated into the parameters' dtype
            for start in range(0, hidden.shape[0], c):
                s = slice(start, start + c)
                h = _cast(hidden[s], compute)
                z = _logits(h, w, b, compute, temp)
                grad_z = _grad_z_(z, targets[s], lse[s], entropy[s], None if g_logp is None else g_logp[s],
                                  None if g_entropy is None else g_entropy[s])
                grad = grad_z.to(h.dtype)
                if d_hidden is not None:
                    if mixed:
                        d_hidden[s] = torch.mm(grad, w)
                    else:
                        torch.mm(grad, w, out=d_hidden[s])
                if d_weight is not None:
                    if mixed:
                        d_weight += torch.mm(grad.t(), h)
                    else:
                        d_weight.addmm_(grad.t(), h)
                if d_bias is not None:
                    d_bias += grad_z.sum(0) if mixed else grad.sum(0)
                del z, grad_z, grad  # before the next chunk's are made: one chunk's [c, V] buffers live at a time
        return d_hidden, d_weight, d_bias, None, None, None


def _logits(h: Tensor, w: Tensor, b: Tensor | None, compute: torch.dtype | None, temperature: float) -> Tensor:
    """One chunk's scaled logits, a fresh float (>= 32-bit) tensor the caller may overwrite: the output layer's
    matmul in the compute dtype, then the division by the temperature in float32 (as `_scaled` does to logits)."""
    z = _float(torch.nn.functional.linear(_cast(h, compute), w, b))
    return z.div_(temperature) if temperature != 1.0 else z


def _autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype autocast casts matmuls on t's device to (None: autocast is off there)."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _cast(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    return t if t is None or dtype is None else t.to(dtype)


def _no_autocast(t: Tensor):
    """Autocast off on t's device: the softmax statistics stay in float32 (on the CPU autocast would run the
    entropy's einsum in bfloat16)."""
    return torch.autocast(t.device.type, enabled=False)


def token_logprobs_and_entropy(logits: Tensor, tokens: Tensor, temperature: float = 1.0,
                               chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """[..., V] logits -> ([...] log-prob of `tokens` under softmax(logits / T), [...] entropy), float32 or wider."""
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] == 0:  # still on the graph: an FSDP2 rank's padding micro-batch must run its backward
        empty = _float(flat).sum(-1).view(lead)
        return empty, empty.clone()
    logp, entropy = _FromLogits.apply(flat, tokens.reshape(-1), float(temperature), max(1, int(chunk)))
    return logp.view(lead), entropy.view(lead)


def head_logprobs_and_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,
                              temperature: float = 1.0, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """[N, D] final hidden states and the output layer -> ([N] log-probs of `tokens`, [N] entropies)."""
    if hidden.shape[0] == 0:
        empty = _float(hidden).sum(-1)
        return empty, empty.clone()
    return _FromHidden.apply(hidden, weight, bias, tokens, float(temperature), max(1, int(chunk)))


def token_entropy(logits: Tensor, chunk_size: int | None = 256) -> Tensor:
    """[B, T, V] logits -> [B, T] full-vocabulary entropy (float32 or wider); differentiable."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits.shape)}")
    tokens = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    chunk = chunk_size if chunk_size else max(1, logits.shape[0] * logits.shape[1])
    return token_logprobs_and_entropy(logits, tokens, 1.0, chunk)[1]
