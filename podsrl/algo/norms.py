"""Which RMSNorm modules the fast engine and the shared-prompt update may compute without calling them."""

from __future__ import annotations

import torch

# transformers' RMSNorm classes whose forward is weight * (x * rsqrt(mean(x^2) + variance_epsilon)), in float32
PLAIN_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def float32_rms_norm(module: torch.nn.Module) -> bool:
    """A plain RMSNorm with float32 weights: on float32 inputs its maths is F.rms_norm's (same bits). In other dtypes
    the module rounds before the weight multiply, so callers run the module there."""
    return type(module).__name__ in PLAIN_RMS_NORMS and module.weight.dtype == torch.float32
