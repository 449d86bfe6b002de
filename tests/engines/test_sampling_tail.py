"""The sampler's CDF over a 152k vocabulary (podsrl/engines/sampling.py): a tail token is sampled with its own mass.
A float32 CDF near 1 moves in steps of 6e-8, so a token of 1e-8 to 5e-8 after a head of ~0.995 gets none or a whole
step (up to twice its mass); CUDA's float32 cumsum also accumulates in float32, which the test reproduces on the
CPU (the CPU's accumulates in float64, then rounds each value to float32: the same steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from podsrl.engines.sampling import sample_with_uniforms

VOCAB = 151936  # Qwen2.5's
PROBES = 32


def head_and_tail() -> torch.Tensor:
    """Logits [V]: token 0 with ~99.5% of the mass, every other token 1e-8 to 5e-8 of it."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.rand(VOCAB, generator=g) * 4e-8 + 1e-8).log()
    logits[0] = 0.0
    return logits


def float32_accumulation(original):
    """Tensor.cumsum as CUDA runs it on float32 without a dtype: accumulated in float32 (numpy's running sum)."""
    def cumsum(tensor, dim=-1, dtype=None):
        if dtype is None and tensor.dtype == torch.float32:
            return torch.from_numpy(np.cumsum(tensor.numpy(), axis=dim, dtype=np.float32))
        return original(tensor, dim, dtype=dtype)

    return cumsum


@pytest.mark.parametrize("accumulation", ["cpu", "float32 (as CUDA)"])
def test_tail_tokens_are_sampled_with_their_own_mass(monkeypatch, accumulation):
    """For tail tokens spread over the vocabulary, the uniform at the middle of the token's own interval of the
    exact CDF (the float32 softmax's probabilities summed in float64) samples that token. Before (a float32 CDF and
    a float32 target), most probes sampled a neighbour: 22 of 32 missed with the CPU's cumsum, all 32 with a
    float32 accumulation."""
    if accumulation != "cpu":
        monkeypatch.setattr(torch.Tensor, "cumsum", float32_accumulation(torch.Tensor.cumsum))
    logits = head_and_tail()
    probs = logits.softmax(-1)
    assert 0.99 < probs[0] < 0.996 and probs[1:].max() < 6e-8  # the tail is under a float32 step near 1
    exact = probs.double().numpy().cumsum()
    tokens = torch.linspace(1, VOCAB - 1, PROBES).long()
    middles = torch.from_numpy((exact[tokens - 1] + exact[tokens]) / 2 / exact[-1])
    sampled, _ = sample_with_uniforms(logits.expand(PROBES, VOCAB), middles, temperature=1.0)
    missed = int((sampled != tokens).sum())
    assert missed == 0, f"{missed} of {PROBES} tail tokens not sampled at the middle of their own mass"
