"""sampling.sample_with_uniforms reads the vocabulary few times: untruncated, one softmax and its cumsum (the
log-prob read from the softmax, no [B, V] log-softmax), with the tokens of the inverse-CDF over a separate
log-softmax and its log-probs to float32 rounding; its draws follow softmax(logits / T) (a chi-square test)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.device_ops import METADATA_OPS
from podsrl.engines.sampling import filter_logits, row_uniforms, sample_with_uniforms

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


@pytest.mark.parametrize("greedy", [False, True])
def test_untruncated_sampling_reads_the_vocabulary_in_two_passes(greedy):
    """float32 logits at temperature 1: a softmax, then its cumsum (sampled) or an argmax of the logits (greedy);
    the search reads log V entries of a row and the log-prob's gather one. A temperature adds its division, bfloat16
    logits their cast to float32. Before: a max, a shift, the exponentials and their cumsum."""
    logits, uniforms = torch.randn(8, V), None if greedy else torch.rand(8)
    with VocabularyReads() as ops:
        sample_with_uniforms(logits, uniforms, 1.0)
    passes = [op for op in ops.ops if op not in ("searchsorted", "gather", *METADATA_OPS)]
    assert passes == (["_softmax", "argmax"] if greedy else ["_softmax", "cumsum"]), ops.ops


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_draws_follow_softmax_of_the_tempered_logits():
    """200,000 draws over 6 tokens with the rows' own counter-based uniforms: chi-square against softmax(logits / T)
    under 20.5 (its 0.999 quantile at 5 degrees of freedom; a fixed seed, so the test is deterministic), while the
    same draws against the untempered softmax, and untempered draws against the tempered one, are far above it; the
    log-probs are log_softmax(logits / T) of the tokens."""
    draws, temperature = 200_000, 0.6
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    uniforms = row_uniforms(torch.arange(draws), 3).float()
    tokens, logprobs = sample_with_uniforms(logits.expand(draws, -1), uniforms, temperature)
    counts = torch.bincount(tokens, minlength=6)
    tempered = (logits / temperature).softmax(-1)
    assert chi_square(counts, tempered) < 20.5
    assert chi_square(counts, logits.softmax(-1)) > 1000
    untempered = torch.bincount(sample_with_uniforms(logits.expand(draws, -1), uniforms, 1.0)[0], minlength=6)
    assert chi_square(untempered, tempered) > 1000
    torch.testing.assert_close(logprobs, (logits / temperature).log_softmax(-1)[tokens], rtol=0, atol=1e-6)
