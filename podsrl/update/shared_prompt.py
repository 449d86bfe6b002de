"""The shared-prompt forward: each distinct prompt of a micro-batch runs once, completions run without padding.

What the plain path computes per row (prompt + completion, padded to the longest of each) is recomputed here as one
packed token stream per micro-batch: the distinct prompts' real tokens, then each row's completion tokens except its
last (no position reads the last token's output). Linear layers, norms and MLPs run over that stream, so their work
is the real tokens, each prompt counted once. Attention runs in padded blocks:
- prompts: [G, Lp] causal self-attention;
- completions: rows bucketed by length (sorted, each bucket padded to its own longest), each row's queries
  attending to its prompt's keys/values (index-expanded from the prompt block, so the prompt's gradient collects
  every row's) and causally to its own completion.
Only positions that predict a completion token reach the output layer, through chunked log-probs/entropy (never a
[tokens, vocab] float32 tensor). Positions and masks are those of the plain path, so log-probs, entropies and
gradients equal it up to float rounding (tests/test_update_shared_prompt.py; sharded, tests/test_fsdp.py). Tokens move
into the attention blocks and back, and q/k/v, the rotary embedding and RMSNorm run, through the autograd functions
of kernels.py: fewer passes over the stream than autograd's own decomposition, which on CPU is most of the
non-matmul time.

Measured choice (`python benchmarks/update_speed.py --attention`, one GSM8K-shaped group of a 200-token prompt and
16 completions of 50-400 tokens, attention forward + backward on one CPU thread, the same attention kernel in both):
one packed sequence per group with a dense block mask took ~12x longer than the index-expanded prompt keys with
length buckets (2.16 vs 0.18 s): on CPU the masked attention is [sum of lengths]^2 whatever the mask allows.

The gate/up projection is one matmul and its SiLU gating one autograd function (`swiglu`).

Drives the decoder layers of Llama, Mistral, Qwen2 and Qwen3 models from their own submodules (LoRA-wrapped ones
included); `unsupported_reason` says why another model falls back to the plain path.

Module hooks (FSDP2): the computation still enters through the model's and each decoder layer's own `__call__`, with
their `forward` swapped for this path's computation for the duration of the call (`_routed`). So whatever is hooked
on those modules runs as around their own forward: FSDP2's `fully_shard` (podsrl/fsdp.py shards each decoder layer,
then the root) all-gathers the unit's parameters before, reshards after, re-gathers them in the backward and
reduce-scatters the gradients after it; the root's hooks queue the end-of-backward callback. Nothing FSDP-specific is
needed here, and one process or DDP runs the same code. Explicit `unshard()` of each unit would gather the
parameters but skip the forward hooks that register FSDP2's backward work (re-gather, gradient reduce-scatter).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from podsrl.algo.attention import grouped_attention
from podsrl.algo.llama_layers import fused_gate_up, fused_qkv
from podsrl.algo.logprobs import head_logprobs_and_entropy
from podsrl.batch import RolloutBatch
from podsrl.transformers_api import (
    LLAMA_FAMILY,
    base_model,
    check_fast_path,
    is_llama_family,
    llama_layout_problem,
    rotary_function,
)
from podsrl.update.kernels import gather_slots, packed_order, rms_norm, rotate_qkv, swiglu

SILU_TYPES = ("SiLU", "SiLUActivation")  # activation modules that are F.silu (transformers' or torch's)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the shared-prompt path cannot drive this model (None when it can). A Llama-family model whose layout
    podsrl cannot find (a transformers release moved it) is an error, not a quiet fallback."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if not is_llama_family(base):
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {', '.join(LLAMA_FAMILY)}"
    check_fast_path(model, "the shared-prompt update", llama_layout_problem(model), "update.shared_prompt: false")
    head = base.lm_head
    if type(head) is not torch.nn.Linear:
        return f"its output layer is a {type(head).__name__}, not a plain Linear (e.g. LoRA on lm_head)"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout > 0 (the plain path's dropout draws could not be reproduced)"
    other = _other_fsdp_unit(model, base.model.layers)
    if other is not None:
        return (f"{other} is an FSDP2 unit of its own: only the root and the decoder layers are called through "
                "their forward here, so its parameters would not be gathered")
    return None


def _other_fsdp_unit(model: torch.nn.Module, layers: torch.nn.ModuleList) -> str | None:
    """The name of an FSDP2-sharded module other than `model` itself and its decoder layers (None: there is none)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    called = {id(model), *(id(layer) for layer in layers)}
    return next((name for name, m in model.named_modules() if isinstance(m, FSDPModule) and id(m) not in called),
                None)


def sliding_window(model: torch.nn.Module) -> int | None:
    """The smallest attention window of any layer (None: full attention everywhere)."""
    config = base_model(model).config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None and all(t == "full_attention" for t in types):
        return None
    return window


@dataclass
class Bucket:
    """Completion rows of similar length, padded to the longest of them: a [rows, width] block of attention slots."""

    group: Tensor  # [rows] prompt of each row
    mask: Tensor  # [rows, 1, width, prompt_width + width] bool: the prompt's real keys, then causal over the completion
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
    prompt_mask: Tensor  # [G, 1, Lp, Lp] bool, causal and real keys only
    buckets: list[Bucket]
    pred_index: Tensor  # [T] packed positions whose output predicts a completion token, row-major
    row_group: Tensor  # [B] each row's distinct prompt (CPU)
    prompt_lengths: Tensor  # [B] real prompt tokens of each row (CPU)
    input_lengths: Tensor  # [B] completion inputs of each row: its tokens but the last (CPU)
    targets: Tensor  # [T] the completion tokens they predict
    valid: Tensor  # [B, W] bool, where the T values go in the row x width output


def build_plan(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
               device: torch.device) -> Plan | None:
    """The plan of rows given as left-padded prompts and right-padded completions; None when a row has an empty
    prompt or a completion mask with holes (the plain path handles those)."""
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
    Lp = int(lp.max())
    # prompts: real tokens packed in group order (left padding is a prefix, so row-major order is token order)
    p_start = lp.cumsum(0) - lp
    n_prompt = int(lp.sum())
    p_tokens = distinct[real]
    p_pos = torch.arange(n_prompt) - p_start.repeat_interleave(lp)
    slot = torch.arange(Lp)
    p_real = slot < lp[:, None]
    prompt_index = torch.where(p_real, p_start[:, None] + slot, p_start[:, None])
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
    for rows in _length_buckets(order, n_in):
        lb = int(n_in[rows[0]])
        cslot = torch.arange(lb)
        c_real = cslot < n_in[rows][:, None]
        slots.append(torch.where(c_real, c_start[rows][:, None] + cslot, c_start[rows][:, None]).flatten())
        real_slots.append(c_real.flatten())
        lpb = int(lp[group[rows]].max())
        prompt_keys = (torch.arange(lpb) < lp[group[rows]][:, None])[:, None, :].expand(-1, lb, -1)
        own = torch.ones(lb, lb, dtype=torch.bool).tril()[None].expand(len(rows), -1, -1)
        mask = torch.cat([prompt_keys, own], dim=2)[:, None]
        buckets.append(Bucket(group[rows].to(device), mask.to(device), lpb, len(rows), lb))
    all_slots, real = torch.cat(slots), torch.cat(real_slots)
    home = torch.empty(n_prompt + c_tokens.numel(), dtype=torch.long)
    home[all_slots[real]] = torch.arange(all_slots.numel())[real]
    # predictions: the prompt's last token predicts completion token 0, completion input j predicts token j + 1
    grid = c_start[:, None] + col - 1
    grid[:, 0] = (p_start + lp - 1)[group]
    pred_index = grid[valid]
    return Plan(
        ids=torch.cat([p_tokens, c_tokens]).to(device),
        positions=torch.cat([p_pos, c_pos]).to(device),
        slots=all_slots.to(device),
        home=home.to(device),
        prompt_shape=(len(lp), Lp),
        prompt_mask=p_attn_mask.to(device),
        buckets=buckets,
        pred_index=pred_index.to(device),
        row_group=group,
        prompt_lengths=lp[group],
        input_lengths=n_in,
        targets=completion_ids[valid].to(device),
        valid=valid.to(device),
    )


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


def _length_buckets(order: Tensor, n_in: Tensor, keep: float = 0.75, min_saving: int = 512) -> list[Tensor]:
    """Rows sorted by length (longest first), cut where a row is shorter than `keep` x its bucket's longest and the
    cut saves at least `min_saving` padded query slots: padding stays under ~1/keep of the real work, and short
    completions (where an attention call costs more than the padding) stay in one call."""
    buckets, start = [], 0
    lengths = n_in[order].tolist()
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or (lengths[i] < keep * lengths[start]
                                 and (lengths[start] - lengths[i]) * (len(lengths) - i) >= min_saving):
            buckets.append(order[start:i])
            start = i
    return buckets


class SharedPromptForward:
    """Log-probs and entropies of rows of a batch under a model it can drive (see `unsupported_reason`)."""

    def __init__(self, model: torch.nn.Module, logits_chunk: int) -> None:
        self.root = model  # called as a whole: its hooks (FSDP2's root unit) run around the computation
        self.base = base_model(model)
        self.body = self.base.model
        self.head = self.base.lm_head
        self.layers = list(self.body.layers[: self.base.config.num_hidden_layers])
        self.window = sliding_window(model)
        self.chunk = logits_chunk
        self.rotary = rotary_function(self.layers[0])  # the model's own rotary application

    def fits(self, batch: RolloutBatch, rows: Tensor, width: int) -> bool:
        """False when some row is longer than a sliding window (then windowed attention would differ)."""
        if self.window is None:
            return True
        longest = int(batch.prompt_mask[rows].sum(dim=1).max()) + width
        return longest <= self.window

    def __call__(self, batch: RolloutBatch, rows: Tensor, width: int, device: torch.device,
                 temperature: float) -> tuple[Tensor, Tensor] | None:
        """([B, width] log-probs, [B, width] entropies; 0 outside the completion mask), or None when this
        micro-batch has rows the plan cannot express."""
        plan = build_plan(batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows, :width],
                          batch.completion_mask[rows, :width], device)
        if plan is None:
            return None
        with self._routed():
            return self.root(plan, temperature)

    @contextmanager
    def _routed(self) -> Iterator[None]:
        """While open, calling the root runs `_model_forward` and calling a decoder layer runs `_layer_forward`
        (instance attributes shadow the class's `forward`; the previous state is restored on exit). Nothing else
        calls the model while an update runs (generation is not concurrent with it)."""
        swapped = [(self.root, self._model_forward)]
        swapped += [(layer, functools.partial(self._layer_forward, layer)) for layer in self.layers]
        saved = [(module, module.__dict__.get("forward")) for module, _ in swapped]
        try:
            for module, forward in swapped:
                module.forward = forward
            yield
        finally:
            for module, previous in saved:
                if previous is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = previous

    def _model_forward(self, plan: Plan, temperature: float) -> tuple[Tensor, Tensor]:
        x = self.body.embed_tokens(plan.ids)
        cos, sin = self.body.rotary_emb(x[None], plan.positions[None])
        for i, layer in enumerate(self.layers):
            x = layer(x, cos[0], sin[0], plan, i == len(self.layers) - 1)
        hidden = rms_norm(self.body.norm, x)
        logp, entropy = head_logprobs_and_entropy(hidden, self.head.weight, self.head.bias, plan.targets,
                                                  temperature, self.chunk)
        zeros = torch.zeros(plan.valid.shape, dtype=logp.dtype, device=logp.device)
        return zeros.masked_scatter(plan.valid, logp), zeros.masked_scatter(plan.valid, entropy)

    def _layer_forward(self, layer: torch.nn.Module, x: Tensor, cos: Tensor, sin: Tensor, plan: Plan,
                       last: bool) -> Tensor:
        attn = layer.self_attn
        q, k, v = self._projections(attn, rms_norm(layer.input_layernorm, x), cos, sin)
        x = x + attn.o_proj(block_attention(q, k, v, plan, attn.scaling))
        if last:  # only predicting positions are read after the last layer
            x = x[plan.pred_index]
        x_mlp = rms_norm(layer.post_attention_layernorm, x)
        gate_up = fused_gate_up(layer.mlp)
        if gate_up is None:
            return x + layer.mlp(x_mlp)
        gate_up = F.linear(x_mlp, gate_up)
        if type(layer.mlp.act_fn).__name__ in SILU_TYPES:
            hidden = swiglu(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = layer.mlp.act_fn(gate) * up
        return x + layer.mlp.down_proj(hidden)

    def _projections(self, attn: torch.nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        """Rotated queries [N, H, d], rotated keys and values [N, Hkv, d]; cos/sin [N, d]. Plain Linear projections
        run as one matmul with the rotation in `rotate_qkv`; Qwen3's per-head
        norms and the model's own rotary function follow it; LoRA-wrapped projections run as their modules."""
        n, head_dim = x.shape[0], attn.head_dim
        heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
        fused = fused_qkv(attn)
        if fused is not None:
            qkv = F.linear(x, *fused).view(n, -1, head_dim)
            if not hasattr(attn, "q_norm"):
                return rotate_qkv(qkv, cos[:, None], sin[:, None], heads, kv_heads)
            q, k, v = qkv.split_with_sizes((heads, kv_heads, kv_heads), dim=1)
        else:
            q = attn.q_proj(x).view(n, -1, head_dim)
            k = attn.k_proj(x).view(n, -1, head_dim)
            v = attn.v_proj(x).view(n, -1, head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rotary(q[None], k[None], cos[None], sin[None], unsqueeze_dim=2)
        return q[0], k[0], v


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
    out = [grouped_attention(block(qs[0], groups, prompt_len), kp, vp, ~plan.prompt_mask, scaling)]
    for i, b in enumerate(plan.buckets, start=1):
        keys = torch.cat([kp[b.group, :, : b.prompt_width], block(ks[i], b.rows, b.width)], dim=2)
        values = torch.cat([vp[b.group, :, : b.prompt_width], block(vs[i], b.rows, b.width)], dim=2)
        out.append(grouped_attention(block(qs[i], b.rows, b.width), keys, values, ~b.mask, scaling))
    # [rows, H, width, d] -> [rows * width, H * d] slots, then each token's own slot
    return packed_order(torch.cat([o.transpose(1, 2).flatten(0, 1).flatten(1) for o in out]), plan.home)
