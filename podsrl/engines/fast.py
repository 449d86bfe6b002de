"""A hand-written decode loop that makes rollouts several times cheaper than `model.generate`.

Where the time goes in GRPO rollouts (many samples of few prompts, varied lengths) and what this loop does about it:
- shared-prompt prefill: each distinct prompt runs through the model once; its KV cache rows are index-expanded
  across its group instead of re-encoding the prompt counts[i] times;
- finished-row compaction: rows that emitted a stop token leave the batch (cache rows index-selected), so the cost
  of a step follows the live rows, not the longest one;
- a pre-allocated KV cache written in place (no per-step concatenation of the whole cache), attending only over the
  filled prefix;
- counter-based per-row sampling (see sampling.py): no multinomial, no global RNG, and a row's completion depends
  only on (weights, prompt, seed, params).
- on Llama/Mistral/Qwen2/Qwen3 models, the decoder stack driven from its own submodules (norms, projections, MLP)
  with q/k/v and gate/up each one matmul and attention as grouped matmuls over the cache (on CPU, SDPA's flash
  kernel and the per-layer forward's dispatch cost more than a decode step's matmuls at RL batch sizes).
Masks and position ids are built here exactly as `generate` builds them, so greedy outputs equal `generate`'s (other
models run the model's own forward). Models it cannot drive fall back to HFEngine with a logged reason.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F

from podsrl.algo.attention import grouped_attention
from podsrl.engines.base import GenerationOutput, RolloutEngine, SamplingParams, left_pad
from podsrl.engines.hf import HFEngine, eval_mode, model_device
from podsrl.engines.rows import (
    check_request,
    completion_mask,
    no_token_output,
    row_prompts,
    special_ids,
    stop_ids,
)
from podsrl.engines.sampling import row_uniforms, sample_with_uniforms

logger = logging.getLogger("podsrl")

try:
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - transformers is a core dependency
    Cache = DynamicCache = DynamicLayer = None  # type: ignore[assignment,misc]


class SlotLayer(DynamicLayer):  # type: ignore[misc,valid-type]
    """One layer's K/V in buffers of fixed capacity, written in place; attention sees only the filled prefix."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.rows = 0  # live batch rows: the leading rows of the buffers

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, key_dim = key_states.shape
        # never read past the filled prefix, so left uninitialised
        self.key_buffer = key_states.new_empty(batch, heads, self.capacity, key_dim)
        self.value_buffer = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.rows = batch
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.key_buffer[: self.rows, :, self.length : end] = key_states
        self.value_buffer[: self.rows, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def _view(self) -> None:
        self.keys = self.key_buffer[: self.rows, :, : self.length]
        self.values = self.value_buffer[: self.rows, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.key_buffer = _select_prefix(self.key_buffer, indices, self.length)
            self.value_buffer = _select_prefix(self.value_buffer, indices, self.length)
            self.rows = indices.numel()
            self._view()

    def fill_holes(self, holes: torch.Tensor, sources: torch.Tensor, rows: int) -> None:
        """Keeps the first `rows` rows, the finished ones among them (`holes`) overwritten by the live rows past
        the end (`sources`): only the filled prefix of as many rows as finished is copied, not the whole batch."""
        if holes.numel():
            self.key_buffer[holes, :, : self.length] = self.key_buffer[sources, :, : self.length]
            self.value_buffer[holes, :, : self.length] = self.value_buffer[sources, :, : self.length]
        self.rows = rows
        self._view()


def _select_prefix(buffer: torch.Tensor, indices: torch.Tensor, length: int) -> torch.Tensor:
    """A buffer of the same capacity holding rows `indices` of `buffer`; only the filled prefix is copied."""
    out = buffer.new_empty((indices.numel(), *buffer.shape[1:]))
    torch.index_select(buffer[:, :, :length], 0, indices, out=out[:, :, :length])
    return out


# Models whose top-level forward is exactly embed -> rotary -> decoder layers -> norm -> lm_head (no embedding
# scale, no logit soft-capping), so the loop can drive their layers itself and skip that forward's per-call work.
LAYER_LOOP_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def layer_loop_body(model: torch.nn.Module) -> torch.nn.Module | None:
    """The inner decoder stack when the fast loop may call the layers directly, else None."""
    inner = getattr(model, "model", None)
    if getattr(model.config, "model_type", None) not in LAYER_LOOP_TYPES or not hasattr(model, "lm_head"):
        return None
    if inner is None or not all(hasattr(inner, n) for n in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return None
    return inner


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fast loop cannot drive this model (None when it can)."""
    if DynamicCache is None:
        return "transformers cache utilities are unavailable"
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        return f"{type(model).__name__} is not a transformers generation model"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    if "past_key_values" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no past_key_values (no KV cache support)"
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in ("sdpa", "eager"):
        return (
            f"attention implementation {attn!r} needs masks built by transformers (only sdpa/eager handled)"
        )
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if any(t != "full_attention" for t in layer_types):
            return f"layer types {sorted(set(layer_types))} include non-full attention"
    elif getattr(config, "sliding_window", None) is not None:
        return "sliding-window attention is not supported"
    return None


class FastEngine(RolloutEngine):
    """Fast in-process sampler; see the module docstring.

    Options: shared_prefill (True), compaction (True), layer_loop (True: drive the decoder layers of
    Llama/Mistral/Qwen2/Qwen3 models from their submodules, see the module docstring), compact_fraction (0.0: compact
    as soon as one row finishes; f > 0: wait until a fraction f of the batch has finished), cache ("static" pre-allocated buffers or "dynamic"
    transformers DynamicCache), eos_token_id, pad_token_id. Outputs are CPU tensors.
    """

    name = "fast"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        shared_prefill: bool = True,
        compaction: bool = True,
        compact_fraction: float = 0.0,
        cache: str = "static",
        layer_loop: bool = True,
        **options: Any,
    ) -> None:
        if cache not in ("static", "dynamic"):
            raise ValueError(f"FastEngine: cache must be 'static' or 'dynamic', got {cache!r}")
        # A peft model wraps the transformers model whose layers carry the adapters in place: drive that one.
        if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            model = model.get_base_model()
        self.model = model
        self.tokenizer = tokenizer
        self.shared_prefill = shared_prefill
        self.compaction = compaction
        self.compact_fraction = compact_fraction
        self.cache_kind = cache
        self.eos_ids, self.pad_token_id = special_ids(model, tokenizer, options)
        self.fallback: HFEngine | None = None
        reason = unsupported_reason(model)
        if reason is not None:
            logger.warning("fast engine: %s; falling back to the hf engine", reason)
            self.fallback = HFEngine(model, tokenizer, **options)
            return
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._body = layer_loop_body(model) if layer_loop else None
        if self._body is not None:
            self._layers = list(self._body.layers[: model.config.num_hidden_layers])
            self._kv_heads = model.config.num_key_value_heads
            self._fused: list[tuple | None] = []

    def generate(
        self,
        prompts: list[list[int]],
        counts: list[int],
        params: SamplingParams,
        seeds: torch.Tensor,
    ) -> GenerationOutput:
        if self.fallback is not None:
            return self.fallback.generate(prompts, counts, params, seeds)
        rows = check_request(prompts, counts, seeds)
        if rows == 0 or params.max_new_tokens <= 0:
            return no_token_output(prompts, counts, rows, self.pad_token_id, params.return_logprobs)
        group_index, prompt_ids, prompt_mask = row_prompts(prompts, counts, self.pad_token_id)
        if self.shared_prefill:
            prefill_ids, prefill_mask, expand = self._distinct_prompts(prompts, counts)
        else:
            prefill_ids, prefill_mask, expand = prompt_ids, prompt_mask, None
        stops = stop_ids(self.eos_ids, params)
        with torch.inference_mode(), eval_mode(self.model):
            if self._body is not None:
                self._fused = self._fused_weights()
            tokens, logprobs = self._decode(prefill_ids, prefill_mask, expand, rows, params, seeds, stops)
        mask, truncated = completion_mask(tokens, stops)
        return GenerationOutput(
            group_index=group_index,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=tokens,
            completion_mask=mask,
            truncated=truncated,
            logprobs=logprobs * mask if params.return_logprobs else None,
        )

    def _distinct_prompts(self, prompts: list[list[int]], counts: list[int]):
        """Left-padded distinct prompts and the row -> distinct prompt index that expands them to rows."""
        slot: dict[tuple[int, ...], int] = {}
        distinct: list[list[int]] = []
        per_used: list[int] = []
        used_counts: list[int] = []
        for prompt, count in zip(prompts, counts):
            if count <= 0:
                continue
            key = tuple(prompt)
            if key not in slot:
                slot[key] = len(distinct)
                distinct.append(prompt)
            per_used.append(slot[key])
            used_counts.append(count)
        ids, mask = left_pad(distinct, self.pad_token_id)
        expand = torch.repeat_interleave(torch.tensor(per_used), torch.tensor(used_counts))
        return ids, mask, expand

    def _attention_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """4D mask from a bool [B, 1, Q, K] 'may attend' tensor, in the form the attention implementation expects."""
        if self.model.config._attn_implementation == "sdpa":
            return allowed
        dtype = next(self.model.parameters()).dtype
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Last-position logits [B, V]."""
        if self._body is not None:
            return self._layer_loop(ids, mask, positions, cache)
        extra = {"logits_to_keep": 1} if self._keep_arg else {}
        out = self.model(
            input_ids=ids,
            attention_mask=self._attention_mask(mask),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        return out.logits[:, -1]

    def _fused_weights(self) -> list[tuple | None]:
        """Per layer, the q/k/v projections' and the MLP's gate/up weights concatenated (one matmul each instead of
        three and two), or None for a layer whose projections are not plain Linear (LoRA) or whose MLP is not the
        gated down(act(gate(x)) * up(x)). Rebuilt every generate call: the optimiser changes the weights in place."""
        fused: list[tuple | None] = []
        for layer in self._layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = [attn.q_proj, attn.k_proj, attn.v_proj]
            gated = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
            if not all(type(m) is torch.nn.Linear for m in projections + gated) or not hasattr(mlp, "act_fn") \
                    or len({m.bias is None for m in projections}) > 1 or gated[0].bias is not None \
                    or gated[1].bias is not None:
                fused.append(None)
                continue
            bias = None if attn.q_proj.bias is None else torch.cat([m.bias for m in projections])
            fused.append((torch.cat([m.weight for m in projections]), bias,
                          torch.cat([gated[0].weight, gated[1].weight]), gated[0].out_features))
        return fused

    def _layer_loop(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """The decoder stack from its submodules: the layers' own norms, projections, rotary and MLP (q/k/v and
        gate/up as one matmul each when `_fused` has them), with attention computed here as grouped matmuls over
        the cache (no per-call attention dispatch, no key/value head repeat; on CPU the fused SDPA kernel cost
        several times the whole matmul work of a decode step). `mask` is the bool [B, 1, Q, K] 'may attend'
        tensor."""
        body = self._body
        hidden = body.embed_tokens(ids)
        cos, sin = body.rotary_emb(hidden, positions)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads of [B, heads, Q, d]
        batch, width = ids.shape
        blocked = ~mask  # [B, 1, Q, K]
        for i, layer in enumerate(self._layers):
            attn, fused = layer.self_attn, self._fused[i]
            x = layer.input_layernorm(hidden)
            if fused is not None:
                qkv = F.linear(x, fused[0], fused[1]).view(batch, width, -1, attn.head_dim).transpose(1, 2)
                heads = qkv.shape[1] - 2 * self._kv_heads
                v = qkv[:, heads + self._kv_heads :]
                if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
                    q = _rotate(attn.q_norm(qkv[:, :heads]), cos, sin)
                    k = _rotate(attn.k_norm(qkv[:, heads : heads + self._kv_heads]), cos, sin)
                else:
                    qk = _rotate(qkv[:, : heads + self._kv_heads], cos, sin)
                    q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = attn.q_proj(x).view(batch, width, -1, attn.head_dim)
                k = attn.k_proj(x).view(batch, width, -1, attn.head_dim)
                v = attn.v_proj(x).view(batch, width, -1, attn.head_dim).transpose(1, 2)
                if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            keys, values = cache.layers[i].update(k, v)
            out = grouped_attention(q, keys, values, blocked, attn.scaling)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, width, -1))
            x = layer.post_attention_layernorm(hidden)
            if fused is not None:
                gate_up = F.linear(x, fused[2])
                mlp = layer.mlp
                x = mlp.down_proj(mlp.act_fn(gate_up[..., : fused[3]]) * gate_up[..., fused[3] :])
            else:
                x = layer.mlp(x)
            hidden = hidden + x
        # the norm is per position, so normalising only the last one gives the same logits
        return self.model.lm_head(body.norm(hidden[:, -1:]))[:, -1]

    def _decode(self, prefill_ids, prefill_mask, expand, rows: int, params: SamplingParams, seeds, stops):
        """Tokens [R, Lc] (pad after a row's stop) and sampled-token log-probs [R, Lc]."""
        device = model_device(self.model)
        width, steps = prefill_ids.shape[1], params.max_new_tokens
        if self.cache_kind == "static":
            layers = [SlotLayer(width + steps) for _ in range(self.model.config.num_hidden_layers)]
            cache = Cache(layers=layers)
        else:
            cache = DynamicCache(config=self.model.config)
        valid = torch.zeros((prefill_ids.shape[0], width + steps), dtype=torch.bool, device=device)
        valid[:, :width] = prefill_mask.to(device).bool()
        positions = (prefill_mask.cumsum(1) - 1).masked_fill(prefill_mask == 0, 0).to(device)
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        logits = self._forward(
            prefill_ids.to(device), causal[None, None] & valid[:, None, None, :width], positions, cache
        )
        next_pos = positions[:, -1] + 1
        if expand is not None:
            expand = expand.to(device)
            cache.batch_select_indices(expand)
            logits, valid, next_pos = logits[expand], valid[expand], next_pos[expand]

        stop_tensor = torch.tensor(stops, dtype=torch.long, device=device)
        live = torch.arange(rows, device=device)  # output row of each batch row
        uniforms = None  # [rows, steps]: every position's uniform hashed at once, not one hash per step
        if not (params.greedy or params.temperature <= 0):
            uniforms = row_uniforms(seeds.long().to(device)[:, None], torch.arange(steps, device=device)[None])
        finished = torch.zeros(rows, dtype=torch.bool, device=device)  # finished rows not yet compacted away
        out_tokens = torch.full((rows, steps), self.pad_token_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=device)
        n_finished, used = 0, steps
        for t in range(steps):
            step_uniforms = None if uniforms is None else uniforms[:, t]
            tokens, logprobs = sample_with_uniforms(
                logits, step_uniforms, params.temperature, params.top_k, params.top_p
            )
            if n_finished:  # finished rows still in the batch emit padding and feed it back
                tokens = tokens.masked_fill(finished, self.pad_token_id)
                logprobs = logprobs.masked_fill(finished, 0.0)
            out_tokens[live, t] = tokens
            out_logprobs[live, t] = logprobs
            finished |= tokens == stop_tensor if stop_tensor.numel() == 1 else torch.isin(tokens, stop_tensor)
            n_finished = int(finished.sum())
            if t == steps - 1 or n_finished == finished.numel():
                used = t + 1
                break
            if self.compaction and n_finished > self.compact_fraction * finished.numel():
                order = compact(cache, finished, n_finished)
                live, tokens, valid, next_pos = live[order], tokens[order], valid[order], next_pos[order]
                uniforms = None if uniforms is None else uniforms[order]
                finished, n_finished = finished[order], 0
            elif n_finished:
                tokens = tokens.masked_fill(finished, self.pad_token_id)
            valid[:, width + t] = True
            logits = self._forward(
                tokens[:, None], valid[:, None, None, : width + t + 1], next_pos[:, None], cache
            )
            next_pos = next_pos + 1
        return out_tokens[:, :used].cpu(), out_logprobs[:, :used].cpu()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [B, heads, Q, d] as transformers applies it to Llama, Mistral and Qwen2/3
    (x cos + rotate_half(x) sin); queries and keys rotate in one call when they are one tensor."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def compact(cache, finished: torch.Tensor, n_finished: int) -> torch.Tensor:
    """Drops the finished rows from the cache; returns the kept batch rows in their new order.

    The live rows past the new batch end move into the finished rows' places before it, so a static cache copies
    only as many rows as finished (other caches index-select the same order).
    """
    rows = finished.numel() - n_finished
    holes = finished[:rows].nonzero().squeeze(1)
    sources = (~finished[rows:]).nonzero().squeeze(1) + rows
    order = torch.arange(rows, device=finished.device)
    order[holes] = sources
    layers = getattr(cache, "layers", None) or []
    if layers and all(isinstance(layer, SlotLayer) for layer in layers):
        for layer in layers:
            layer.fill_holes(holes, sources, rows)
    else:
        cache.batch_select_indices(order)
    return order
