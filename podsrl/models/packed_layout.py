"""The packed token stream of the shared-prompt forward and attention over it.

What the plain path computes per row (prompt + completion, padded to the longest of each) is laid out here as one
packed token stream per micro-batch: the distinct prompts' real tokens, then each row's completion tokens except its
last (no position reads the last token's output). Linear layers, norms and MLPs run over that stream, so their work
is the real tokens, each prompt counted once. Attention runs in padded blocks (`block_attention`):
- prompts: [G, Lp] causal self-attention;
- completions: rows bucketed by length (sorted, each bucket padded to its own longest), each row's queries
  attending to its prompt's keys/values (index-expanded from the prompt block, so the prompt's gradient collects
  every row's) and causally to its own completion.
Positions and masks are those of the plain path. With `ladder` (CUDA's default) each block's row and token counts
are rounded up to podsrl/models/shape_ladder.py's sizes, so attention's shapes repeat across batches: the extra rows
and slots are padding, fully blocked as keys and never read as queries.

Measured choice (`python benchmarks/update_speed.py --attention`, one GSM8K-shaped group of a 200-token prompt and
16 completions of 50-400 tokens, attention forward + backward on one CPU thread, the same attention kernel in both):
one packed sequence per group with a dense block mask took ~12x longer than the index-expanded prompt keys with
length buckets (2.16 vs 0.18 s): on CPU the masked attention is [sum of lengths]^2 whatever the mask allows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from podsrl.models.attention import grouped_attention
from podsrl.models.kernels import gather_slots, packed_order
from podsrl.models.shape_ladder import ladder_default, rung
from podsrl.models.transfer import to_device

# On the ladder a length cut must also save this many padded query slots per row of the micro-batch. Fixed at 512
# slots, the study's 19 -> 14 cut saved 410-555 at 512 rows (optim.micro_batch_size=auto on an H200): it came and
# went between batches, and with it new attention shapes (0.50 an update after step 10, 0.07 at 256 rows). Scaled
# with the rows, the cuts no longer depend on the micro-batch's size; at 4 a row the study's micro-batches are cut
# twice (new shapes per update after step 10: 0.12 at 512 rows, 0.03 at 256; at 2 a row 0.25 and 0.07), for ~12%
# more padded attention slots. The CPU keeps the fixed threshold: no per-shape set-up there, and padding is its cost.
LADDER_CUT_PER_ROW = 4


@dataclass
class Bucket:
    """Completion rows of similar length, padded to the longest of them: a [rows, width] block of attention slots."""

    group: Tensor  # [rows] prompt of each row
    # [rows, 1, width, prompt_width + width] bool, True where a query may not attend: the prompt's padding, then the
    # completion's later tokens
    blocked: Tensor
    allowed: Tensor  # ~blocked, but every key for a query with none (padding): what scaled_dot_product_attention reads
    prompt_width: int  # the longest prompt of these rows
    rows: int
    width: int


@dataclass
class Plan:
    """Index tensors of one micro-batch's packed stream (built on CPU, moved to the device once)."""

    ids: Tensor  # [N] packed tokens: distinct prompts, then completion inputs
    positions: Tensor  # [N]
    slots: Tensor  # [S] packed index of each attention slot: the prompt block [G, Lp], then each bucket's block,
    # row-major; padding slots repeat a real token
    home: Tensor  # [N] each packed token's own (real) slot
    prompt_shape: tuple[int, int]  # (G, Lp)
    prompt_blocked: Tensor  # [G, 1, Lp, Lp] bool, True where a query may not attend (later or padding keys)
    prompt_allowed: Tensor  # its `allowed` (see Bucket)
    buckets: list[Bucket]
    pred_index: Tensor  # [T] packed positions whose output predicts a completion token, row-major
    row_group: Tensor  # [B] each row's distinct prompt (CPU)
    prompt_lengths: Tensor  # [B] real prompt tokens of each row (CPU)
    input_lengths: Tensor  # [B] completion inputs of each row: its tokens but the last (CPU)
    targets: Tensor  # [T] the completion tokens they predict
    output_shape: tuple[int, int]  # (B, W) of the row x width output
    output_index: Tensor  # [T] where the T values go in the flattened [B * W] output, row-major


def build_plan(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
               device: torch.device, ladder: bool | None = None) -> Plan | None:
    """The plan of rows given as left-padded prompts and right-padded completions; None when a row has an empty
    prompt or a completion mask with holes (the plain path handles those). Built on the host from host tensors; its
    device tensors arrive in two copies (podsrl/models/transfer.py), not one per tensor. `ladder` (None: on CUDA
    only) rounds the attention blocks' sizes up to the shape ladder."""
    laddered = ladder_default(device.type) if ladder is None else ladder
    size = rung if laddered else int
    W = completion_ids.shape[1]
    lengths = completion_mask.sum(dim=1).long()
    col = torch.arange(W)
    valid = col < lengths[:, None]
    if not torch.equal(valid, completion_mask.bool()):
        return None
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)
    distinct, group = distinct_rows(key)
    real = distinct >= 0
    lp = real.sum(dim=1)
    if bool((lp == 0).any()):
        return None
    Lp = size(int(lp.max()))
    # prompts: real tokens packed in group order (left padding is a prefix, so row-major order is token order)
    p_start = lp.cumsum(0) - lp
    n_prompt = int(lp.sum())
    p_tokens = distinct[real]
    p_pos = torch.arange(n_prompt) - p_start.repeat_interleave(lp)
    slot = torch.arange(Lp)
    blank_prompts = size(len(lp)) - len(lp)  # ladder rows of no prompt: every slot padding (token 0)
    p_real = slot < _pad(lp, blank_prompts)[:, None]
    p_first = _pad(p_start, blank_prompts)[:, None]
    prompt_index = torch.where(p_real, p_first + slot, p_first)
    causal = torch.ones(Lp, Lp, dtype=torch.bool).tril()
    p_attn_mask = (causal[None] & p_real[:, None, :])[:, None]
    # completions: all tokens but the last are inputs
    n_in = (lengths - 1).clamp(min=0)
    c_start = n_prompt + n_in.cumsum(0) - n_in
    c_in = col < n_in[:, None]
    c_tokens = completion_ids[c_in]
    c_pos = (lp[group][:, None] + col)[c_in]
    buckets = []
    slots, real_slots = [prompt_index.flatten()], [p_real.flatten()]
    order = torch.argsort(n_in, descending=True, stable=True)
    order = order[n_in[order] > 0]
    for rows in _length_buckets(order, n_in, per_row=LADDER_CUT_PER_ROW if laddered else 0):
        lb, blank = size(int(n_in[rows[0]])), size(len(rows)) - len(rows)  # ladder rows: no token, no key
        cslot = torch.arange(lb)
        row_len, row_start, row_group = (_pad(t, blank) for t in (n_in[rows], c_start[rows], group[rows]))
        c_real = cslot < row_len[:, None]
        slots.append(torch.where(c_real, row_start[:, None] + cslot, row_start[:, None]).flatten())
        real_slots.append(c_real.flatten())
        lpb = size(int(lp[group[rows]].max()))  # <= Lp: the ladder keeps order
        row_lp = _pad(lp[group[rows]], blank)
        prompt_keys = (torch.arange(lpb) < row_lp[:, None])[:, None, :].expand(-1, lb, -1)
        own = torch.ones(lb, lb, dtype=torch.bool).tril()[None] & (row_len > 0)[:, None, None]
        blocked = ~torch.cat([prompt_keys, own], dim=2)[:, None]
        buckets.append(Bucket(row_group, blocked, _allowed(blocked), lpb, len(row_len), lb))
    all_slots, real = torch.cat(slots), torch.cat(real_slots)
    home = torch.empty(n_prompt + c_tokens.numel(), dtype=torch.long)
    home[all_slots[real]] = torch.arange(all_slots.numel())[real]
    # predictions: the prompt's last token predicts completion token 0, completion input j predicts token j + 1
    grid = c_start[:, None] + col - 1
    grid[:, 0] = (p_start + lp - 1)[group]
    pred_index = grid[valid]
    host = [torch.cat([p_tokens, c_tokens]), torch.cat([p_pos, c_pos]), all_slots, home, ~p_attn_mask,
            _allowed(~p_attn_mask), pred_index, completion_ids[valid], valid.flatten().nonzero()[:, 0]]
    host += [t for b in buckets for t in (b.group, b.blocked, b.allowed)]
    ids, positions, slots, home, prompt_blocked, prompt_allowed, pred_index, targets, output_index, *per_bucket = (
        to_device(host, device))
    for b, i in zip(buckets, range(0, len(per_bucket), 3)):
        b.group, b.blocked, b.allowed = per_bucket[i:i + 3]
    return Plan(
        ids=ids,
        positions=positions,
        slots=slots,
        home=home,
        prompt_shape=(len(lp) + blank_prompts, Lp),
        prompt_blocked=prompt_blocked,
        prompt_allowed=prompt_allowed,
        buckets=buckets,
        pred_index=pred_index,
        row_group=group,
        prompt_lengths=lp[group],
        input_lengths=n_in,
        targets=targets,
        output_shape=(valid.shape[0], W),
        output_index=output_index,
    )


def _allowed(blocked: Tensor) -> Tensor:
    """The 'may attend' mask scaled_dot_product_attention reads: ~blocked, and every key for a query with none (a
    padding slot, which no real position reads: its output only has to stay finite). Made on the host once per
    micro-batch, not in every layer's call (four launches each)."""
    return ~blocked | blocked.all(dim=-1, keepdim=True)


def _pad(values: Tensor, blank: int) -> Tensor:
    """`values` and `blank` zeros after them (the ladder's padding rows: no tokens, slots pointing at token 0)."""
    return torch.cat([values, values.new_zeros(blank)]) if blank else values


def distinct_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct rows of an integer matrix and each row's index among them: `torch.unique(rows, dim=0,
    return_inverse=True)` up to the order of the distinct rows, without its per-row loop on the CPU (~5 operations a
    row, most of a plan's cost). Rows are grouped by a hash, every row is checked against its group's first, and a
    hash collision (never seen; the check makes it harmless) falls back to torch.unique."""
    hashes = (rows * _hash_weights(rows.shape[1])).sum(dim=1)
    keys, inverse = torch.unique(hashes, return_inverse=True)
    first = torch.full((len(keys),), len(hashes)).scatter_reduce_(0, inverse, torch.arange(len(hashes)), "amin")
    distinct = rows[first]
    if not torch.equal(distinct[inverse], rows):
        return torch.unique(rows, dim=0, return_inverse=True)
    return distinct, inverse


@functools.cache
def _hash_weights(width: int) -> Tensor:
    """Fixed random multipliers below 2^31: with token ids below 2^21, sums of up to 2^11 products stay in int64."""
    return torch.randint(1, 2**31, (width,), generator=torch.Generator().manual_seed(width))


def _length_buckets(order: Tensor, n_in: Tensor, keep: float = 0.75, min_saving: int = 512,
                    per_row: int = 0) -> list[Tensor]:
    """Rows sorted by length (longest first), cut where a row is shorter than `keep` x its bucket's longest and the
    cut saves at least `min_saving` padded query slots, and `per_row` a row: padding stays under ~1/keep of the real
    work, and short completions (where an attention call costs more than the padding) stay in one call."""
    buckets, start = [], 0
    lengths = n_in[order].tolist()
    min_saving = max(min_saving, per_row * len(lengths))
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or (lengths[i] < keep * lengths[start]
                                 and (lengths[start] - lengths[i]) * (len(lengths) - i) >= min_saving):
            buckets.append(order[start:i])
            start = i
    return buckets


def block_attend(q: Tensor, keys: Tensor, values: Tensor, blocked: Tensor, allowed: Tensor, scaling: float) -> Tensor:
    """One block's attention: on the CPU grouped_attention's matmuls (reading `blocked`), elsewhere
    `sdpa_block_attend`."""
    if q.device.type == "cpu":
        return grouped_attention(q, keys, values, blocked, scaling)
    return sdpa_block_attend(q, keys, values, blocked, allowed, scaling)


def sdpa_block_attend(q: Tensor, keys: Tensor, values: Tensor, blocked: Tensor, allowed: Tensor,
                      scaling: float) -> Tensor:
    """scaled_dot_product_attention over the plan's `allowed` mask (no mask work per call). Unlike fused_attention
    a query with every key blocked is not zeroed (its output is a padding slot's, never read, so 0 gradient)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scaling,
                                          enable_gqa=q.shape[1] != keys.shape[1])


def block_attention(q: Tensor, k: Tensor, v: Tensor, plan: Plan, scaling: float) -> Tensor:
    """Attention of packed queries [N, H, d] over packed keys/values [N, Hkv, d] as the plan lays them out: prompts
    as a [G, Lp] causal block, each length bucket's completions over their prompt's keys (index-expanded, so the
    prompt's gradient collects every row's) and causally over their own. Returns [N, H * d] in packed order."""
    groups, prompt_len = plan.prompt_shape
    sizes = [groups * prompt_len] + [b.rows * b.width for b in plan.buckets]
    qs, ks, vs = (gather_slots(t, plan.slots, plan.home).split(sizes) for t in (q, k, v))

    def block(t: Tensor, rows: int, width: int) -> Tensor:  # [rows * width, h, d] -> [rows, h, width, d]
        return t.view(rows, width, *t.shape[1:]).transpose(1, 2)

    kp, vp = block(ks[0], groups, prompt_len), block(vs[0], groups, prompt_len)
    out = [block_attend(block(qs[0], groups, prompt_len), kp, vp, plan.prompt_blocked, plan.prompt_allowed, scaling)]
    for i, b in enumerate(plan.buckets, start=1):
        keys = torch.cat([kp[b.group, :, : b.prompt_width], block(ks[i], b.rows, b.width)], dim=2)
        values = torch.cat([vp[b.group, :, : b.prompt_width], block(vs[i], b.rows, b.width)], dim=2)
        out.append(block_attend(block(qs[i], b.rows, b.width), keys, values, b.blocked, b.allowed, scaling))
    # [rows, H, width, d] -> [rows * width, H * d] slots, then each token's own slot
    return packed_order(torch.cat([o.transpose(1, 2).flatten(0, 1).flatten(1) for o in out]), plan.home)
