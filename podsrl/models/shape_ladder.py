"""A fixed ladder of sizes that the update's attention blocks are rounded up to on CUDA.

On CUDA, `scaled_dot_product_attention` in bfloat16 with a mask prefers cuDNN (torch >= 2.11, cuDNN >= 9.15 on sm90),
which builds an execution plan for each new shape (tens to hundreds of ms a build). The packed update's blocks
(podsrl/models/packed_layout.py) are sized by each batch's prompts and completion lengths, so nearly every update
brought new shapes. Rounding each block's row and token counts up to this ladder makes the shapes repeat: a few
dozen rungs cover 1 to 10^5, and a block is padded by at most a quarter. The padding is masked out (fully blocked
rows and keys), so the results are those of the exact layout, which the CPU keeps (no per-shape set-up there).
"""

from __future__ import annotations

STEPS = (4, 5, 6, 7)  # 1, 1.25, 1.5, 1.75 x 2^k


def rung(n: int) -> int:
    """The smallest ladder size >= n: n itself up to 4, then the smallest m x 2^k >= n with m in 4..7."""
    if n <= 4:
        return max(n, 0)
    shift = max(0, n.bit_length() - 3)  # n < 8 x 2^shift, so some m in 4..7 (or 8, the next octave's 4) covers it
    m = -(-n // (1 << shift))
    return m << shift


def ladder_default(device_type: str) -> bool:
    """Whether the layout is rounded up to the ladder by default on a device of this type ("cuda", "cpu"): on CUDA
    only. (A type, not a torch.device: the memory plan asks too, without torch.)"""
    return device_type == "cuda"
