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
  kernel and the per-layer forward's dispatch cost more than a decode step's matmuls at RL batch sizes); at those
  sizes a CPU decode step's other cost is per-op dispatch, so the loop binds its modules, weights and norms once per
  call, looks rotary cos/sin up in a per-call table, and spends as few ops per layer as give the same bits.
Masks and position ids are built here exactly as `generate` builds them, so greedy outputs equal `generate`'s (other
models run the model's own forward). A Llama-family model it cannot drive is an error naming the cause (see
transformers_api.check_fast_path); other models it cannot drive fall back to HFEngine, logged and recorded.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from podsrl.algo.attention import decode_attention, decode_bias, grouped_attention
from podsrl.algo.llama_layers import (
    fused_gate_up,
    fused_qkv,
    norm_function,
    rotate,
    signed_sin,
)
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
from podsrl.engines.slot_cache import SlotLayer, compact
from podsrl.transformers_api import (
    Cache,
    DynamicCache,
    base_model,
    cache_argument,
    check_fast_path,
    forward_with_cache,
    is_llama_family,
    llama_layout_problem,
    new_dynamic_cache,
)

logger = logging.getLogger("podsrl")


def layer_loop_body(model: torch.nn.Module) -> torch.nn.Module | None:
    """The inner decoder stack when the fast loop may call the layers directly, else None."""
    # their top-level forward is exactly embed -> rotary -> decoder layers -> norm -> lm_head (no embedding scale,
    # no logit soft-capping), so the loop can drive their layers itself and skip that forward's per-call work
    if not is_llama_family(model) or llama_layout_problem(model) is not None:
        return None
    # the loop looks cos/sin up in a per-generate table: not for rotary types whose frequencies follow the
    # longest position of each call
    if getattr(model.model.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
        return None
    return model.model


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fast loop cannot drive this model (None when it can)."""
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
        model = base_model(model)  # a peft wrapper's base model: its layers carry the adapters in place
        self.model = model
        self.tokenizer = tokenizer
        self.shared_prefill = shared_prefill
        self.compaction = compaction
        self.compact_fraction = compact_fraction
        self.cache_kind = cache
        self.eos_ids, self.pad_token_id = special_ids(model, tokenizer, options)
        self.fallback: HFEngine | None = None
        reason = unsupported_reason(model)
        check_fast_path(model, "the fast engine", reason, "rollout.engine: hf")
        if reason is not None:  # an architecture the loop does not know: model.generate, said once and recorded
            logger.warning("fast engine: %s; falling back to the hf engine", reason)
            self.fallback = HFEngine(model, tokenizer, **options)
            self.fallback_reason = reason
            return
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        if layer_loop:
            check_fast_path(model, "the fast engine's layer loop", llama_layout_problem(model),
                            "rollout.engine_options: {layer_loop: false}")
        self._body = layer_loop_body(model) if layer_loop else None
        if self._body is not None:
            self._layers = list(self._body.layers[: model.config.num_hidden_layers])
            self._kv_heads = model.config.num_key_value_heads
            self._plans: list[LayerPlan] = []

    @property
    def sampler(self) -> str:
        return self.name if self.fallback is None else self.fallback.name

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
            if self._body is not None:  # bound per call: the optimiser changes the weights in place
                self._plans = [layer_plan(layer) for layer in self._layers]
                self._final_norm = norm_function(self._body.norm)
                self._rotary = self._rotary_table(prefill_ids.shape[1] + params.max_new_tokens)
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
        out = forward_with_cache(self.model, cache, input_ids=ids, attention_mask=self._attention_mask(mask),
                                 position_ids=positions, **extra)
        return out.logits[:, -1]

    def _rotary_table(self, length: int) -> torch.Tensor:
        """[length, 2 d]: per position, the model's rotary cos and signed sin (as `rotate` takes them), computed once
        per generate call and looked up per step (the values are per position)."""
        weight = self._body.embed_tokens.weight
        cos, sin = self._body.rotary_emb(weight[:1], torch.arange(length, device=weight.device)[None])
        return torch.cat((cos[0], signed_sin(sin[0])), dim=-1)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at `positions` [B, Q] from the table, [B, 1, Q, d] each (broadcast over the heads of
        [B, heads, Q, d])."""
        return F.embedding(positions, self._rotary).unflatten(-1, (2, -1))[:, None].unbind(-2)

    def _layer_loop(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """The decoder stack from its submodules as the layers' plans bind them: the layers' own norms, projections,
        rotary and MLP (q/k/v and gate/up as one matmul each where fused), with attention computed here as grouped
        matmuls over the cache (no per-call attention dispatch, no key/value head repeat; on CPU the fused SDPA
        kernel cost several times the whole matmul work of a decode step), through decode_attention for the
        one-query decode steps on CPU. `mask` is the bool [B, 1, Q, K] 'may attend' tensor."""
        hidden = self._body.embed_tokens(ids)
        cos, sin = self._cos_sin(positions)
        batch, width = ids.shape
        if width == 1 and hidden.device.type == "cpu":
            attend, blocked = decode_attention, decode_bias(mask, self._kv_heads, hidden.dtype)  # for all layers
        else:
            attend, blocked = grouped_attention, ~mask  # [B, 1, Q, K]
        for i, plan in enumerate(self._plans):
            attn = plan.attn
            x = plan.input_norm(hidden)
            if plan.qkv is not None:
                qkv = F.linear(x, *plan.qkv).view(batch, width, -1, attn.head_dim).transpose(1, 2)
                sizes = (qkv.shape[1] - 2 * self._kv_heads, self._kv_heads, self._kv_heads)  # q, k, v heads
                if plan.qk_norms is not None:  # Qwen3: per-head RMSNorm before the rotation
                    q, k, v = qkv.split_with_sizes(sizes, dim=1)
                    q, k = rotate(plan.qk_norms[0](q), cos, sin), rotate(plan.qk_norms[1](k), cos, sin)
                else:
                    qk, v = qkv.split_with_sizes((sizes[0] + sizes[1], sizes[2]), dim=1)
                    q, k = rotate(qk, cos, sin).split_with_sizes(sizes[:2], dim=1)
            else:
                q = attn.q_proj(x).view(batch, width, -1, attn.head_dim)
                k = attn.k_proj(x).view(batch, width, -1, attn.head_dim)
                v = attn.v_proj(x).view(batch, width, -1, attn.head_dim).transpose(1, 2)
                if plan.qk_norms is not None:
                    q, k = plan.qk_norms[0](q), plan.qk_norms[1](k)
                q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
            keys, values = cache.layers[i].update(k, v)
            out = attend(q, keys, values, blocked, attn.scaling)
            out = out.transpose(1, 2).reshape(batch, width, -1)
            hidden = hidden + plan.o_proj(out)
            x = plan.post_norm(hidden)
            if plan.gate_up is not None:
                gate, up = F.linear(x, plan.gate_up).chunk(2, dim=-1)
                x = plan.down_proj(plan.act_fn(gate) * up)
            else:
                x = plan.mlp(x)
            hidden = hidden + x
        # the norm is per position, so normalising only the last one gives the same logits
        return self.model.lm_head(self._final_norm(hidden[:, -1:]))[:, -1]

    def _decode(self, prefill_ids, prefill_mask, expand, rows: int, params: SamplingParams, seeds, stops):
        """Tokens [R, Lc] (pad after a row's stop) and sampled-token log-probs [R, Lc]."""
        device = model_device(self.model)
        width, steps = prefill_ids.shape[1], params.max_new_tokens
        if self.cache_kind == "static":
            layers = [SlotLayer(width + steps) for _ in range(self.model.config.num_hidden_layers)]
            cache = Cache(layers=layers)
        else:
            cache = new_dynamic_cache(self.model)
        # generated positions are always valid: set up front, so a step only widens the slice it reads
        valid = torch.ones((prefill_ids.shape[0], width + steps), dtype=torch.bool, device=device)
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
            # in float32 once: sample_with_uniforms would convert them to it every step (the same values)
            uniforms = row_uniforms(seeds.long().to(device)[:, None], torch.arange(steps, device=device)[None]).float()
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
            logits = self._forward(
                tokens[:, None], valid[:, None, None, : width + t + 1], next_pos[:, None], cache
            )
            next_pos = next_pos + 1
        return out_tokens[:, :used].cpu(), out_logprobs[:, :used].cpu()


class LayerPlan(NamedTuple):
    """One decoder layer as the layer loop runs it, bound once per generate call: each step then indexes a tuple
    instead of looking up submodules and parameters (~1 us each, a third of a small op)."""

    attn: torch.nn.Module
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    qkv: tuple[torch.Tensor, torch.Tensor | None] | None  # q/k/v weight and bias concatenated; None: one by one
    qk_norms: tuple[Callable, Callable] | None  # Qwen3's per-head q and k norms
    o_proj: torch.nn.Module
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    mlp: torch.nn.Module
    gate_up: torch.Tensor | None  # gate and up weights concatenated; None: the MLP module as a whole
    act_fn: Callable[[torch.Tensor], torch.Tensor] | None
    down_proj: torch.nn.Module | None


def layer_plan(layer: torch.nn.Module) -> LayerPlan:
    """The layer's plan: q/k/v and gate/up each one matmul (instead of three and two) where they are plain Linear
    (not LoRA-wrapped) and the MLP is the gated down(act(gate(x)) * up(x))."""
    attn, mlp = layer.self_attn, layer.mlp
    gate_up = fused_gate_up(mlp)
    qk_norms = (norm_function(attn.q_norm), norm_function(attn.k_norm)) if hasattr(attn, "q_norm") else None
    return LayerPlan(
        attn=attn,
        input_norm=norm_function(layer.input_layernorm),
        qkv=fused_qkv(attn),
        qk_norms=qk_norms,
        o_proj=attn.o_proj,
        post_norm=norm_function(layer.post_attention_layernorm),
        mlp=mlp,
        gate_up=gate_up,
        act_fn=None if gate_up is None else mlp.act_fn,
        down_proj=None if gate_up is None else mlp.down_proj,
    )
