"""The update's attention in the memory plan (podsrl/planning/memory.py): the blocks the packed layout builds for a
micro-batch, and what one layer's attention saves for its backward over them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from podsrl.models.shape_ladder import ladder_default, rung

if TYPE_CHECKING:
    from podsrl.planning.workload import MicroBatch, ModelShape, Workload


def attention_saved(shape: ModelShape, mb: MicroBatch, work: Workload) -> int:
    """Bytes one layer's attention saves for its backward (podsrl/models/packed_layout.py block_attention over the
    prompt block [G, Lp] and the completions' bucket [b, Lc - 1] with keys Lp + Lc - 1).

    CPU (attention.grouped_attention): per block the queries, keys and values as the batched matmuls read them
    (contiguous copies of the transposed blocks; the completions' keys and values are their concatenation with the
    prompt's), the float32 softmax (plus its compute-dtype cast when e < 4) and the inverted bool mask. Elsewhere
    (attention.fused_attention, scaled_dot_product_attention): the gathered key and value streams (the blocks are
    views of them), per block the masked queries, the output, the float32 log-sum-exp, the bool mask and its
    additive float form, and the completions' concatenated keys and values."""
    e, d, h, hkv = work.e, shape.head_dim, shape.heads, shape.kv_heads
    blocks = attention_blocks(mb, work)
    slots = sum(rows * queries for rows, queries, _ in blocks)  # the gathered streams' length (padding included)
    total = 0 if work.device == "cpu" else 2 * slots * hkv * d * e
    for rows, queries, keys in blocks:
        q_elems, qk, kv_elems = rows * queries * h * d, rows * queries * keys, 2 * rows * hkv * keys * d
        if work.device == "cpu":
            probs = 4 + (e if e < 4 else 0)
            total += (q_elems + kv_elems) * e + rows * h * queries * keys * probs + qk
        else:
            total += 2 * q_elems * e + rows * h * queries * 4 + qk * (1 + e) + (kv_elems * e if keys > queries else 0)
    return total


def attention_blocks(mb: MicroBatch, work: Workload) -> list[tuple[int, int, int]]:
    """(rows, queries, keys) of the micro-batch's attention blocks (podsrl/models/packed_layout.py build_plan): the
    prompts' [G, Lp] over Lp keys, the completions' [b, Lc - 1] over Lp + Lc - 1. On CUDA each count is rounded
    up to the shape ladder (models/shape_ladder.py rung: up to a quarter more per side), as the layout lays them."""
    size = rung if ladder_default(work.device) else int
    blocks = [(size(mb.groups), size(mb.prompt_length), size(mb.prompt_length))]
    if mb.width > 0:
        blocks.append((size(mb.rows), size(mb.width), size(mb.prompt_length) + size(mb.width)))
    return blocks
