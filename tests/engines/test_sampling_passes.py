"""sampling.sample_with_uniforms reads the vocabulary few times: the log-prob comes from the normaliser the CDF
already holds (no [B, V] log-softmax), with the tokens of the inverse-CDF over a separate log-softmax, bit for bit,
and its log-probs to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from podsrl.engines.sampling import filter_logits, sample_with_uniforms

V = 1000


def separate_log_softmax(logits, uniforms, temperature, top_k=0, top_p=1.0):
    """The inverse-CDF sampler with its log-probs from a whole log-softmax (how sampling.py computed them)."""
    scaled = logits.float() / temperature
    logp = scaled.log_softmax(dim=-1)
    if uniforms is None:
        tokens = logits.argmax(dim=-1)
    else:
        kept = filter_logits(scaled, top_k, top_p)
        cdf = (kept - kept.amax(dim=-1, keepdim=True)).exp().cumsum(dim=-1)
        total = cdf[..., -1:]
        target = torch.minimum(uniforms.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class VocabularyReads(TorchDispatchMode):
    """Counts the ops that read or write a tensor whose last dimension is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in (*args, *(out if isinstance(out, tuple) else (out,))) if isinstance(t, torch.Tensor)]
        if any(t.dim() and t.shape[-1] == V for t in tensors):
            self.ops.append(func.__name__.split(".")[0])
        return out


@pytest.mark.parametrize("top_k, top_p, greedy", [(0, 1.0, False), (20, 1.0, False), (0, 0.9, False),
                                                   (0, 1.0, True)])
def test_same_tokens_and_log_probs_as_a_separate_log_softmax(top_k, top_p, greedy):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, V, generator=generator) * 3
    uniforms = None if greedy else torch.rand(64, generator=generator)
    tokens, logprobs = sample_with_uniforms(logits, uniforms, 0.7, top_k, top_p)
    ref_tokens, ref_logprobs = separate_log_softmax(logits, uniforms, 0.7, top_k, top_p)
    assert torch.equal(tokens, ref_tokens)
    assert (logprobs - ref_logprobs).abs().max() <= 1e-5  # float32 rounding of logits of size ~10


def test_sampling_without_truncation_reads_the_vocabulary_less():
    """Untruncated sampling: scale, max, shift, exp, cumsum, the search and the token's gather; the separate
    log-softmax added its own (a max, a sum of exponentials and a [B, V] write) and a second max."""
    logits, uniforms = torch.randn(8, V), torch.rand(8)
    with VocabularyReads() as now:
        sample_with_uniforms(logits, uniforms, 0.7)
    with VocabularyReads() as before:
        separate_log_softmax(logits, uniforms, 0.7)
    assert "_log_softmax" in before.ops and "_log_softmax" not in now.ops
    assert len(now.ops) < len(before.ops), (now.ops, before.ops)
