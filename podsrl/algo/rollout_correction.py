"""Rollout correction: importance weights for the mismatch between the sampler and the trainer.

The sampler (a bf16 weights copy, vLLM's kernels, or weights some updates old) gives the sampled tokens other
probabilities than the trainer does. The PPO ratio compares the trainer with itself, so it never sees that gap;
this module measures it and turns it into a per-token weight on the loss, as TRL's GRPOTrainer does for vLLM rollouts
(`vllm_importance_sampling_correction`, `vllm_importance_sampling_mode`) and verl's `RolloutCorrectionConfig`.

With d = trainer log-prob - sampler log-prob on each sampled token (0 on padding):
  token modes:    rho_t = exp(d_t), one ratio per token;
  sequence modes: rho = exp(sum_t d_t), the product of the token ratios (TRL's definition, not the geometric mean),
                  one ratio per sequence, applied to all its tokens.
  *_tis (TRL *_truncate): weight = clamp(rho, cap_low, cap)             (truncated importance sampling)
  *_mask (TRL *_mask):    weight = rho inside [cap_low, cap], else 0    (masked importance sampling)
The weight multiplies the per-token loss and carries no gradient. A masked token or sequence keeps its place in the
loss aggregation's denominator (TRL multiplies the loss and leaves the completion mask alone).

Pure functions of log-prob tensors: callers pass whatever trainer log-probs the batch is trained against (the current
weights, or the learner's latest weights for batches sampled under older ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from podsrl.models.transfer import host_values

# podsrl name -> TRL's vllm_importance_sampling_mode
ROLLOUT_CORRECTION_MODES: dict[str, str | None] = {
    "none": None,
    "token_tis": "token_truncate",
    "token_mask": "token_mask",
    "sequence_tis": "sequence_truncate",
    "sequence_mask": "sequence_mask",
}
TRL_DEFAULT_MODE = "sequence_mask"  # GRPOConfig.vllm_importance_sampling_mode's default (TRL 1.16)


@dataclass(frozen=True)
class RolloutCorrection:
    weight: torch.Tensor  # [B, T] float: multiplies the per-token loss; 0 on padding and on masked tokens/sequences
    keep: torch.Tensor  # [B, T] bool: completion tokens not masked out (all of them in the *_tis modes)
    metrics: dict[str, torch.Tensor]  # name -> 0-dim tensor (no host sync until read)

    def metric_values(self) -> dict[str, float]:
        return dict(zip(self.metrics, host_values(list(self.metrics.values()))))  # one read, not one per metric


def rollout_correction(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, completion_mask: torch.Tensor,
                       mode: str, cap: float, cap_low: float = 0.0) -> RolloutCorrection:
    """Weights and metrics for `mode` (a key of ROLLOUT_CORRECTION_MODES) from [B, T] log-probs of the sampled tokens.

    `trainer_logprobs` are the log-probs under the policy the batch is trained against (detached here). Metrics:
    TRL's `sampling/sampling_logp_difference/{mean,max}` (|d| over completion tokens) and
    `sampling/importance_sampling_ratio/{min,mean,max}` (the weights after truncation or masking, over tokens in the
    token modes and over sequences in the sequence modes), the share of those units clipped or masked, and verl's
    `rollout_corr/kl` (k1: mean of -d, the direct estimate of KL(sampler || trainer) from tokens the sampler drew)
    and `rollout_corr/k3_kl` (k3: mean of exp(d) - d - 1, non-negative and lower-variance). Empty input gives 0s.
    """
    if ROLLOUT_CORRECTION_MODES.get(mode) is None:
        raise ValueError(f"rollout_correction: mode must be one of "
                         f"{[m for m, trl in ROLLOUT_CORRECTION_MODES.items() if trl]}, got {mode!r}")
    mask = completion_mask.to(torch.float32)
    valid = mask > 0
    diff = (trainer_logprobs.detach().float() - sampler_logprobs.float()) * mask
    diff = torch.nan_to_num(diff, nan=0.0)  # a token the sampler gave no log-prob for is left uncorrected, as TRL
    sequence_level = mode.startswith("sequence")
    ratio = torch.exp(diff.sum(dim=1, keepdim=True) if sequence_level else diff)  # [B, 1] or [B, T]
    outside = (ratio < cap_low) | (ratio > cap)
    if mode.endswith("_tis"):
        corrected = ratio.clamp(min=cap_low, max=cap)
        keep_unit = torch.ones_like(outside)
    else:
        corrected = ratio.masked_fill(outside, 0.0)
        keep_unit = ~outside
    weight = corrected.expand_as(mask) * mask
    keep = keep_unit.expand_as(valid) & valid

    units = valid.any(dim=1, keepdim=True) if sequence_level else valid  # the sequences or tokens that count
    abs_diff = diff.abs()
    share = "clipped" if mode.endswith("_tis") else "masked"
    metrics = {
        "sampling/sampling_logp_difference/mean": _masked_mean(abs_diff, valid),
        "sampling/sampling_logp_difference/max": _masked_max(abs_diff, valid),
        "sampling/importance_sampling_ratio/min": -_masked_max(-corrected, units),  # min = -max(-x)
        "sampling/importance_sampling_ratio/mean": _masked_mean(corrected, units),
        "sampling/importance_sampling_ratio/max": _masked_max(corrected, units),
        f"sampling/importance_sampling_ratio/{share}_fraction": _masked_mean(outside.float(), units),
        "rollout_corr/kl": _masked_mean(-diff, valid),
        "rollout_corr/k3_kl": _masked_mean(torch.exp(diff) - diff - 1, valid),
    }
    return RolloutCorrection(weight=weight, keep=keep, metrics=metrics)


def _masked_mean(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    where = where.expand_as(values)
    return (values * where).sum() / where.sum().clamp(min=1)


def _masked_max(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Max over `where`, 0 when it is empty (no host sync)."""
    where = where.expand_as(values)
    if values.numel() == 0:
        return values.new_zeros(())
    return torch.where(where.any(), torch.where(where, values, -torch.inf).amax(), 0.0)


def uncorrected_staleness(cfg) -> str | None:
    """The warning for a run that trains stale batches unchecked (None when it does not): train.async with
    max_staleness > 0, no rollout correction and one pass, where the PPO ratio is the trainer's log-prob over
    itself (1 by construction), so neither a correction nor the clip sees that the batch was sampled under older
    weights. With several passes the sampler's log-probs are PPO's old log-probs and the clip bounds the lag."""
    run_ahead = cfg.train.asynchronous
    passes = cfg.optim.epochs * cfg.optim.mini_batches
    if cfg.algo.rollout_correction != "none" or not run_ahead.runs_ahead or passes > 1:
        return None
    return (f"algo.rollout_correction: none with train.async.max_staleness {run_ahead.max_staleness} and one pass "
            "trains each batch as if it were on-policy, though it was sampled up to "
            f"{run_ahead.max_staleness} optimiser steps ago: the PPO ratio is 1 by construction, so neither a "
            "correction nor the clip sees the lag. Set algo.rollout_correction: auto (or a mode) to weigh stale "
            "batches, or optim.epochs / optim.mini_batches above 1 to clip against the sampler's log-probs")
