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
- on Llama/Mistral/Qwen2/Qwen3 models, the decoder stack driven layer by layer by podsrl/models/decode.py (q/k/v
  and gate/up each one matmul, attention as grouped matmuls over the cache, as few ops per layer as give the same
  bits).
Masks and position ids are built here exactly as `generate` builds them, so greedy outputs equal `generate`'s (other
models run the model's own forward). A Llama-family model it cannot drive is an error naming the cause (see
models/transformers_api.check_fast_path); other models it cannot drive fall back to HFEngine, logged and recorded.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

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
from podsrl.models.decode import DecodeStack, ModelForward, cached_forward_problem, stack_body
from podsrl.models.static_cache import SlotLayer, compact
from podsrl.models.transformers_api import (
    Cache,
    base_model,
    check_fast_path,
    llama_layout_problem,
    new_dynamic_cache,
)

logger = logging.getLogger("podsrl")


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
        reason = cached_forward_problem(model)
        check_fast_path(model, "the fast engine", reason, "rollout.engine: hf")
        if reason is not None:  # an architecture the loop does not know: model.generate, said once and recorded
            logger.warning("fast engine: %s; falling back to the hf engine", reason)
            self.fallback = HFEngine(model, tokenizer, **options)
            self.fallback_reason = reason
            return
        if layer_loop:
            check_fast_path(model, "the fast engine's layer loop", llama_layout_problem(model),
                            "rollout.engine_options: {layer_loop: false}")
        body = stack_body(model) if layer_loop else None
        self.forward = ModelForward(model) if body is None else DecodeStack(model, body)

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
            self.forward.begin(prefill_ids.shape[1] + params.max_new_tokens)
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
        logits = self.forward.logits(
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
            logits = self.forward.logits(
                tokens[:, None], valid[:, None, None, : width + t + 1], next_pos[:, None], cache
            )
            next_pos = next_pos + 1
        return out_tokens[:, :used].cpu(), out_logprobs[:, :used].cpu()

