"""The plan's attention terms (podsrl/planning/attention.py): on CUDA the update's attention is counted at the blocks
the packed layout lays on the shape ladder, not at the exact sizes."""

from __future__ import annotations

import dataclasses

import torch
from transformers import Qwen2Config

from podsrl.planning import memory as mp
from podsrl.planning import workload as mw
from tests.planning.test_memory_plan import QWEN_1_5B


def test_the_updates_attention_is_counted_at_the_blocks_cuda_lays_on_the_shape_ladder():
    """On CUDA the packed layout rounds each attention block's rows and tokens up to the shape ladder (up to a
    quarter more per side); the plan counts the blocks the layout builds (build_plan with the ladder, run on the
    host), so the padding is not paid from the reserve. A micro-batch of 9 full-length rows of 2 prompts, 37 + 70
    tokens: blocks [2, 40] over 40 keys and [10, 80] over 120, where the exact sizes are [2, 37] and [9, 69] over
    106 (Qwen2.5-1.5B's attention: 27% more saved). Before, the plan counted the exact sizes on CUDA too."""
    from podsrl.models.packed_layout import build_plan
    from podsrl.planning.attention import attention_blocks

    shape = mw.model_shape(Qwen2Config(**QWEN_1_5B))
    mb = mp.MicroBatch(rows=9, groups=2, prompt_length=37, completion_length=70)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 100, (2, 37), generator=g)[torch.tensor([0] * 5 + [1] * 4)]
    completions = torch.randint(1, 100, (9, 70), generator=g)
    layout = build_plan(prompts, torch.ones_like(prompts), completions, torch.ones_like(completions),
                        torch.device("cpu"), ladder=True)
    laid = [(*layout.prompt_shape, layout.prompt_shape[1])] + [
        (b.rows, b.width, b.prompt_width + b.width) for b in layout.buckets]
    cuda = mw.Workload(prompts=2, n=5, m=5, prompt_length=37, completion_length=70, compute_dtype="bfloat16",
                       device="cuda")
    assert laid == attention_blocks(mb, cuda) == [(2, 40, 40), (10, 80, 120)]
    assert attention_blocks(mb, dataclasses.replace(cuda, device="cpu")) == [(2, 37, 37), (9, 69, 106)]
    e, h, hkv, d = 2, 12, 2, 128
    by_hand = 2 * layout.slots.numel() * hkv * d * e + sum(
        2 * rows * q * h * d * e + rows * h * q * 4 + rows * q * k * (1 + e) + (2 * rows * hkv * k * d * e if k > q else 0)
        for rows, q, k in laid)
    assert mp.attention_saved(shape, mb, cuda) == by_hand
    exact = mp.attention_saved(shape, mb, dataclasses.replace(cuda, device="mps"))  # exact sizes, same formula
    assert 1.25 < by_hand / exact < 1.35
