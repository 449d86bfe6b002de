"""The fast engine's model forward over a KV cache: last-position logits of one prefill or decode step.

On Llama/Mistral/Qwen2/Qwen3 models the decoder stack runs as `DecodeStack`: the one layer of podsrl/models/llama.py
with attention as grouped matmuls over the cache (on CPU, SDPA's flash kernel and the per-layer forward's dispatch
cost more than a decode step's matmuls at RL batch sizes); at those sizes a CPU decode step's other cost is per-op
dispatch, so the stack binds its layers' plans and a rotary cos/sin table once (kept across generate calls while the
parameters keep their addresses, the fused weights refreshed in place), and spends as few ops per layer as give the
same bits. Off the CPU (`fused_attention`) a one-query step's attention is one SDPA a layer and its rotation and
residual adds round once (13 ops a layer: benchmarks/decode_ops.py). The same forward serves the engine's
static-shape decode step (podsrl/engines/decode_step.py), whose cache (keys and values in one buffer a layer) is
written in one op at a column given as a tensor. Other models run their own forward (`ModelForward`) with
masks and position ids built as `generate` builds them. `cached_forward_problem` says why a model can take neither.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from podsrl.models.attention import (
    decode_attention,
    decode_bias,
    fused_decode_attention,
    grouped_attention,
    sdpa_bias,
)
from podsrl.models.kernels import rotate_fused, signed_sin
from podsrl.models.llama import (
    LayerPlan,
    decoder_layer,
    layer_plan,
    norm_function,
    refresh_fused,
    share_fused_storage,
)
from podsrl.models.transformers_api import (
    DynamicCache,
    base_model,
    cache_argument,
    forward_with_cache,
    is_llama_family,
    llama_layout_problem,
)


def cached_forward_problem(model: torch.nn.Module) -> str | None:
    """Why the model's forward cannot run over podsrl's caches and masks (None when it can)."""
    if DynamicCache is None:
        return "transformers cache utilities are unavailable"
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        return f"{type(model).__name__} is not a transformers generation model"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    if cache_argument(model) is None:
        return f"{type(model).__name__}.forward takes no KV cache argument"
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in ("sdpa", "eager"):
        return f"attention implementation {attn!r} needs masks built by transformers (only sdpa/eager handled)"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if any(t != "full_attention" for t in layer_types):
            return f"layer types {sorted(set(layer_types))} include non-full attention"
    elif getattr(config, "sliding_window", None) is not None:
        return "sliding-window attention is not supported"
    return None


def stack_body(model: torch.nn.Module) -> torch.nn.Module | None:
    """The inner decoder stack when `DecodeStack` may drive it, else None."""
    # their top-level forward is exactly embed -> rotary -> decoder layers -> norm -> lm_head (no embedding scale,
    # no logit soft-capping), so the stack can drive their layers itself and skip that forward's per-call work
    if not is_llama_family(model) or llama_layout_problem(model) is not None:
        return None
    # cos/sin come from a per-generate table: not for rotary types whose frequencies follow the longest position
    # of each call
    if getattr(model.model.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
        return None
    return model.model


def share_fused_weights(model: torch.nn.Module) -> None:
    """For weights that are only sampled from, never trained or saved (the fast engine's own copy, train.async's
    generator copy): each decoder layer's q/k/v and gate/up projections become views of the fused tensors the layer
    loop reads (llama.share_fused_storage), so those cost no second copy. Other architectures are left as they are."""
    model = base_model(model)
    body = stack_body(model)
    if body is not None:
        share_fused_storage(list(body.layers[: model.config.num_hidden_layers]))


class ModelForward:
    """Last-position logits [B, V] from the model's own forward, reading and extending the cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters

    def begin(self, length: int) -> None:
        """Nothing to bind per generate call."""

    def logits(self, ids: Tensor, mask: Tensor, positions: Tensor, cache) -> Tensor:
        extra = {"logits_to_keep": 1} if self.keep_arg else {}
        out = forward_with_cache(self.model, cache, input_ids=ids, attention_mask=self._attention_mask(mask),
                                 position_ids=positions, **extra)
        return out.logits[:, -1]

    def _attention_mask(self, allowed: Tensor) -> Tensor:
        """4D mask from a bool [B, 1, Q, K] 'may attend' tensor, in the form the attention implementation expects."""
        if self.model.config._attn_implementation == "sdpa":
            return allowed
        dtype = next(self.model.parameters()).dtype
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)


class DecodeStack:
    """Last-position logits [B, V] from the decoder stack driven layer by layer (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, body: torch.nn.Module) -> None:
        self.model, self.body = model, body
        self.layers = list(body.layers[: model.config.num_hidden_layers])
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.plans: list[LayerPlan] = []
        self.rotary: Tensor | None = None
        self.bound: tuple[int, ...] | None = None  # the parameters' addresses the plans were bound to
        self.binding = 0  # counts bindings: a captured step graph reads one binding's tensors
        # one-query steps through scaled_dot_product_attention and the one-rounding rotation (None: off the CPU)
        self.fused_attention: bool | None = None
        self.fused = False  # what the binding chose

    def begin(self, length: int) -> None:
        """Binds the layers' plans and the rotary table for a generate call of at most `length` positions. A
        binding is kept while the parameters keep their addresses (the optimiser updates them in place) and the
        table is long enough: then only the fused q/k/v and gate/up weights are refreshed, in place, so that a
        captured step graph reads today's weights at the addresses it captured."""
        addresses = tuple(p.data_ptr() for p in self.model.parameters())
        weight = self.body.embed_tokens.weight
        fused = self.fused_attention if self.fused_attention is not None else weight.device.type != "cpu"
        if (addresses == self.bound and fused == self.fused and self.rotary is not None
                and self.rotary.shape[0] > length):
            for plan, layer in zip(self.plans, self.layers):
                refresh_fused(plan, layer)
            return
        config = self.model.config
        # off the CPU the one-query attention is SDPA's, not transformers' bits, and the rotation and the residual
        # adds (inside the matmuls) round once too
        rotation = functools.partial(rotate_fused, fma=fused)
        self.plans = [layer_plan(layer, i, config, autograd=False, heads_first=True)._replace(
            rotate_qkv=rotation, fold_residual=fused) for i, layer in enumerate(self.layers)]
        self.fused = fused
        self.final_norm = norm_function(self.body.norm)
        self.rotary = self.rotary_table(length)
        self.bound = addresses
        self.binding += 1

    def rotary_table(self, length: int) -> Tensor:
        """[length + 1, 2 d]: per position, the model's rotary cos and signed sin (as `rotate` takes them), computed
        once per binding and looked up per step (the values are per position); the last row, cos 1 and sin 0, turns
        nothing (the value heads' row in `head_tables`)."""
        weight = self.body.embed_tokens.weight
        cos, sin = self.body.rotary_emb(weight[:1], torch.arange(length, device=weight.device)[None])
        identity = torch.cat((torch.ones_like(cos[0, :1]), torch.zeros_like(sin[0, :1])), dim=-1)
        return torch.cat((torch.cat((cos[0], signed_sin(sin[0])), dim=-1), identity))

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin at `positions` [B, Q] from the table, [B, 1, Q, d] each (broadcast over the heads of
        [B, heads, Q, d])."""
        return F.embedding(positions, self.rotary).unflatten(-1, (2, -1))[:, None].unbind(-2)

    def head_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin per head for one-query steps, [B, heads + 2 kv_heads, 1, d] each: the row's position
        for the query and key heads, the table's identity row for the value heads, so that one rotation turns the
        layer's whole q/k/v projection (kernels.rotate_fused). Built once per step for all layers."""
        heads = self.plans[0].heads + self.kv_heads
        index = F.pad(positions.expand(-1, heads), (0, self.kv_heads), value=self.rotary.shape[0] - 1)
        return F.embedding(index, self.rotary)[:, :, None].unflatten(-1, (2, -1)).unbind(-2)

    def logits(self, ids: Tensor, mask: Tensor, positions: Tensor, cache) -> Tensor:
        """`mask` is the bool [B, 1, Q, K] 'may attend' tensor over the cache after this call's keys."""
        return self.forward(ids, mask, positions, lambda index, kv: cache.layers[index].update(*kv.chunk(2, dim=1)))

    def forward(self, ids: Tensor, mask: Tensor, positions: Tensor, update: KVUpdate) -> Tensor:
        """Last-position logits of `ids` [B, Q] at `positions` [B, Q]; `update(layer index, kv)` stores a layer's
        new keys stacked over its values ([B, 2 Hkv, Q, d]) and returns the keys and values its queries attend over
        ([B, Hkv, K, d], K the last dimension of the bool 'may attend' `mask` [B, 1, Q, K])."""
        hidden = self.body.embed_tokens(ids)
        cos, sin = self.head_tables(positions) if ids.shape[1] == 1 else self.cos_sin(positions)
        attend = CacheAttention(update, mask, self.kv_heads, hidden, self.fused)
        for plan in self.plans:
            hidden = decoder_layer(plan, hidden, cos, sin, attend)
        # the norm is per position, so normalising only the last one gives the same logits
        return self.model.lm_head(self.final_norm(hidden[:, -1:]))[:, -1]


# stores one layer's new keys and values and returns what its queries attend over: (layer index, keys stacked over
# values [B, 2 Hkv, Q, d]) -> (keys, values)
KVUpdate = Callable[[int, Tensor], tuple[Tensor, Tensor]]


class CacheAttention:
    """Attention of one forward call's queries over the KV cache, after storing its keys and values: for one-query
    decode steps, through decode_attention's grouped matmuls on the CPU (no per-call attention dispatch, no
    key/value head repeat) or, `fused` (off the CPU), one scaled_dot_product_attention a layer (fused_decode_attention),
    either way with the additive mask built once for all layers; a prefill through grouped_attention."""

    def __init__(self, update: KVUpdate, mask: Tensor, kv_heads: int, hidden: Tensor, fused: bool) -> None:
        self.update = update
        if hidden.shape[1] > 1:
            self.attend, self.blocked = grouped_attention, ~mask  # [B, 1, Q, K]
        elif fused:
            self.attend, self.blocked = fused_decode_attention, sdpa_bias(mask, hidden.dtype)
        else:
            self.attend, self.blocked = decode_attention, decode_bias(mask, kv_heads, hidden.dtype)

    def __call__(self, plan: LayerPlan, q: Tensor, kv: Tensor) -> Tensor:
        """q [B, H, Q, d], keys stacked over values kv [B, 2 Hkv, Q, d] -> [B, Q, H * d]."""
        keys, values = self.update(plan.index, kv)
        out = self.attend(q, keys, values, self.blocked, plan.scaling)
        return out.transpose(1, 2).flatten(2)
