"""Token-level advantage modulation (docs/methods.md#dynamo, DynaMO); its entropy comes from podsrl.models.logprobs.

The trainer calls a modulation once per micro-batch, after the forward pass, and multiplies the advantages
by the returned factor before the clipped policy loss: A_final = A * factor. Factors are computed under
no_grad, so no gradient flows through them. All normalisations (max |ΔH|, H_min, H_max) run over the
micro-batch's valid tokens only, so padding never shifts them.
"""

from __future__ import annotations

import torch
from torch import Tensor

_EPS = 1e-8


def _masked_stats(values: Tensor, valid: Tensor, prefix: str) -> dict[str, float]:
    if not bool(valid.any()):
        return {f"{prefix}_mean": 1.0, f"{prefix}_min": 1.0, f"{prefix}_max": 1.0}
    v = values[valid]
    return {
        f"{prefix}_mean": float(v.mean()),
        f"{prefix}_min": float(v.min()),
        f"{prefix}_max": float(v.max()),
    }


@torch.no_grad()
def dynamo_modulation(
    advantages: Tensor,
    log_ratio: Tensor,
    logprobs: Tensor,
    entropy: Tensor,
    mask: Tensor,
    epsilon_low: float,
    epsilon_high: float,
    lambda_min: float,
    gamma: float,
    tau: float,
    mu_max: float,
    stabilize: bool,
    compensate: bool,
) -> tuple[Tensor, dict[str, float]]:
    """DynaMO factor [B,T] = β_stab · β_comp (1 at masked tokens) and its metrics.

    advantages: [B,T] (or [B], broadcast over T); log_ratio: log π_θ − log π_old of the sampled tokens;
    logprobs: log π_θ of the sampled tokens; entropy: full-vocabulary entropy H_t of π_θ; mask: valid tokens.

    - ξ_t = I_t ρ_t A_t, I_t = 1 unless the clipped objective has cut the token's gradient;
    - u_t = π_t (log π_t + H_t); ΔH_t = −ξ_t (u_t − mean of u over the sequence's valid tokens);
    - x_t = |ΔH_t| / (max over valid tokens + 1e-8); β_stab = λ_min + (1 − λ_min) σ(−γ (x_t − τ)),
      which damps only the tokens whose predicted entropy change is near the micro-batch's largest;
    - β_comp = 1 + (μ_max − 1)(H_max − H_t)/(H_max − H_min + 1e-8) where A > 0, else 1: boosts confident
      positive tokens. The ratio lies in [0, 1) for any entropies, so β_comp ∈ [1, μ_max); equal entropies
      give exactly 1.
    """
    valid = mask.bool()
    shape = valid.shape
    dtype = (
        torch.promote_types(advantages.dtype, torch.float32)
        if advantages.is_floating_point()
        else torch.float32
    )
    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand(shape)
    ones = torch.ones(shape, dtype=dtype, device=adv.device)

    stab = ones
    if stabilize:
        ratio = log_ratio.detach().to(dtype).exp()
        unclipped = ((adv > 0) & (ratio <= 1.0 + epsilon_high)) | ((adv < 0) & (ratio >= 1.0 - epsilon_low))
        xi = torch.where(unclipped & valid, ratio * adv, torch.zeros_like(adv))
        logp = logprobs.detach().to(dtype)
        u = torch.where(valid, logp.exp() * (logp + entropy.detach().to(dtype)), torch.zeros_like(adv))
        u_mean = u.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
        delta_h = torch.where(valid, -xi * (u - u_mean), torch.zeros_like(adv)).abs()
        peak = delta_h.max() if delta_h.numel() else 0.0  # no rows at all: an FSDP rank's padding micro-batch
        x = delta_h / (peak + _EPS)  # masked entries are 0, so the max is over valid tokens (or 0)
        stab = lambda_min + (1.0 - lambda_min) * torch.sigmoid(-gamma * (x - tau))
        stab = torch.where(valid, stab, ones)

    comp = ones
    if compensate and bool(valid.any()):
        h = entropy.detach().to(dtype)
        h_min = torch.where(valid, h, torch.full_like(h, torch.inf)).min()
        h_max = torch.where(valid, h, torch.full_like(h, -torch.inf)).max()
        boost = 1.0 + (mu_max - 1.0) * (h_max - h) / (h_max - h_min + _EPS)
        comp = torch.where(valid & (adv > 0), boost, ones)

    factor = stab * comp
    metrics = {
        **_masked_stats(stab, valid, "modulation/stab"),
        **_masked_stats(comp, valid, "modulation/comp"),
    }
    return factor, metrics
