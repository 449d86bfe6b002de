"""Split-half estimate of the gradient noise of a step, nearly free: no extra forward or backward pass.

The prompt groups of a mini-batch are split at random into halves A and B (a and b groups, a + b = K) and the
gradient accumulated over A's micro-batches, g_A, is snapshotted; g_B = g - g_A at the end. The token weights are
normalised over the whole mini-batch, so g is the sum of per-group contributions c_k. For exchangeable groups (prompts
drawn at random, each with its rollouts)

    noise_var = a * b * ||g_A / a - g_B / b||^2       (= ||g_A - g_B||^2 when a = b)

is an unbiased estimate of tr Cov(g), the total variance of the step's gradient estimator: averaged over splits it
equals K/(K-1) * sum_k ||c_k - mean(c)||^2 = K * (sample variance of the c_k), whatever a is. ||g||^2 is logged as
the signal (||g||^2 - noise_var is unbiased for ||E g||^2).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch


def split_seed(generator: torch.Generator) -> int:
    """A seed derived from the generator's state without advancing it: the run's stream is the same with or
    without the estimate, and the split is independent of the draws the generator makes next."""
    digest = hashlib.sha256(b"grad-noise-split" + generator.get_state().numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def split_halves(group_index: torch.Tensor, seed: int) -> tuple[torch.Tensor, int, int] | None:
    """[rows] bool mask of half A (a random floor(K/2) of the K groups present), a and b; None below 2 groups."""
    groups = group_index.unique()
    if groups.numel() < 2:
        return None
    perm = torch.randperm(groups.numel(), generator=torch.Generator().manual_seed(seed))
    a = groups.numel() // 2
    return torch.isin(group_index, groups[perm[:a]]), a, groups.numel() - a


def expected_noise_var(contributions: torch.Tensor) -> float:
    """The estimator's mean over all splits, from [K, D] per-group gradient contributions (for tests and checks)."""
    c = contributions.double()
    k = c.shape[0]
    return float(k / (k - 1) * (c - c.mean(dim=0)).pow(2).sum())


class SplitHalfProbe:
    """Holds g_A between the two halves of a mini-batch and turns (g_A, g) into metrics."""

    def __init__(self, params: list[torch.nn.Parameter], in_a: torch.Tensor, a: int, b: int) -> None:
        self.params, self.in_a, self.a, self.b = params, in_a, a, b
        self.first: list[torch.Tensor] = []

    def halves(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The mini-batch's rows (positions in the same order as `in_a`) as [A's rows, B's rows]."""
        return [rows[self.in_a], rows[~self.in_a]]

    def snapshot(self) -> None:
        """Copy the gradient accumulated so far (half A; this rank's share under data parallel)."""
        self.first = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def metrics(self, all_reduce_: Callable[[list[torch.Tensor]], None] | None = None) -> dict[str, float]:
        """grad/* metrics from g_A and the current (summed over ranks, unclipped) gradient g. `all_reduce_` sums
        the snapshot over ranks in place; empty when the gradient is not finite."""
        if all_reduce_ is not None:
            all_reduce_(self.first)
        noise = signal = 0.0
        for p, ga in zip(self.params, self.first):
            g = p.grad.detach().float() if p.grad is not None else torch.zeros_like(ga, dtype=torch.float32)
            ga = ga.float()
            noise += float((ga / self.a - (g - ga) / self.b).pow(2).sum())
            signal += float(g.pow(2).sum())
        self.first = []
        noise *= self.a * self.b
        if not (math.isfinite(noise) and math.isfinite(signal)):
            return {}
        metrics = {"grad/noise_var": noise, "grad/signal": signal}
        if signal > 0:
            metrics["grad/noise_to_signal"] = noise / signal
        return metrics


def make_probe(params: list[torch.nn.Parameter], group_index: torch.Tensor,
               generator: torch.Generator) -> SplitHalfProbe | None:
    """A probe for a mini-batch whose rows have groups `group_index`, or None when it holds fewer than 2 groups."""
    split = split_halves(group_index, split_seed(generator))
    return None if split is None else SplitHalfProbe(params, *split)
