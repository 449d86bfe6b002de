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
- on those models, each decode step one function of static shapes with no host synchronisation inside
  (decode_step.py): forward, sampling and stop flags; under `cuda_graphs` one CUDA graph per (rows, cache length)
  bucket is captured and replayed, so a step costs its kernels, not their launches.
Masks and position ids are built here exactly as `generate` builds them, so greedy outputs equal `generate`'s (other
models run the model's own forward). A Llama-family model it cannot drive is an error naming the cause (see
models/transformers_api.check_fast_path); other models it cannot drive fall back to HFEngine, logged and recorded.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from podsrl.engines.base import GenerationOutput, RolloutEngine, SamplingParams, left_pad
from podsrl.engines.decode_step import Buckets, Sampler, StepRunner, StepState, cached_step, step_uniforms
from podsrl.engines.hf import HFEngine, eval_mode, model_device
from podsrl.engines.rows import (
    check_request,
    completion_mask,
    no_token_output,
    row_prompts,
    special_ids,
    stop_ids,
)
from podsrl.engines.sampling import sample_next
from podsrl.errors import ConfigError
from podsrl.models.decode import (
    DecodeStack,
    ModelForward,
    cached_forward_problem,
    share_fused_weights,
    stack_body,
)
from podsrl.models.static_cache import SlotLayer, compact, compaction_moves
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

    Options (rollout.engine_options):
    - shared_prefill (True), compaction (True), compact_fraction (0.0: compact as soon as one row finishes; f > 0:
      wait until a fraction f of the batch has finished);
    - layer_loop (True: drive the decoder layers of Llama/Mistral/Qwen2/Qwen3 models from their submodules, see the
      module docstring); cache ("static" pre-allocated buffers or "dynamic" transformers DynamicCache);
    - cuda_graphs (None: on when the model is on a CUDA device and the layer loop runs with the static cache):
      capture one CUDA graph of the decode step per bucket and replay it. The engine then keeps its KV cache and
      step state between calls (sized for the largest call so far, rows to a power of two, positions to a multiple
      of cache_block): the graphs replay at those addresses;
    - compile (False): run the step under torch.compile(fullgraph=True, dynamic=False), one compilation per bucket
      (True: inductor; a string: that backend); with cuda_graphs the compiled step is what is captured;
    - cache_block (64): with cuda_graphs or compile, a step attends over the filled cache rounded up to a multiple of
      this, its rows rounded up to a power of two (eager decoding runs the live shapes);
    - weights_dtype (None): sample from the engine's own copy of the model in this dtype (a torch.dtype or its name)
      when it differs from the model's parameters' (e.g. bfloat16 for an fp32-master policy), made once and
      refreshed in place by sync_weights; log-probs stay float32;
    - eos_token_id, pad_token_id.
    Outputs are CPU tensors.
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
        cuda_graphs: bool | None = None,
        compile: bool | str = False,
        cache_block: int = 64,
        weights_dtype: torch.dtype | str | None = None,
        **options: Any,
    ) -> None:
        if cache not in ("static", "dynamic"):
            raise ValueError(f"FastEngine: cache must be 'static' or 'dynamic', got {cache!r}")
        if cache_block < 1:
            raise ConfigError(f"rollout.engine_options.cache_block: must be >= 1, got {cache_block}")
        model = base_model(model)  # a peft wrapper's base model: its layers carry the adapters in place
        self.copy = compute_copy(model, weights_dtype)
        model = self.copy or model
        self.model = model
        self.tokenizer = tokenizer
        self.shared_prefill = shared_prefill
        self.compaction = compaction
        self.compact_fraction = compact_fraction
        self.cache_kind = cache
        self.eos_ids, self.pad_token_id = special_ids(model, tokenizer, options)
        self.fallback: HFEngine | None = None
        self.runner: StepRunner | None = None
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
        if self.copy is not None:  # only sampled from: its projections hold the fused weights
            share_fused_weights(self.copy)
        self.forward = ModelForward(model) if body is None else DecodeStack(model, body)
        self._setup_steps(cuda_graphs, compile, cache_block)

    def _setup_steps(self, cuda_graphs: bool | None, compile: bool | str, cache_block: int) -> None:
        """The static-shape step's runner (layer loop and static cache only) and its buckets."""
        steppable = isinstance(self.forward, DecodeStack) and self.cache_kind == "static"
        on_cuda = model_device(self.model).type == "cuda"
        if cuda_graphs is None:
            cuda_graphs = steppable and on_cuda
        for option, value in (("cuda_graphs", cuda_graphs), ("compile", compile)):
            if value and not steppable:
                raise ConfigError(f"rollout.engine_options.{option}: the static-shape decode step needs the layer "
                                  "loop (a Llama/Mistral/Qwen2/Qwen3 model, layer_loop: true) and cache: static")
        if cuda_graphs and not on_cuda:
            raise ConfigError(f"rollout.engine_options.cuda_graphs: the model is on {model_device(self.model)}, "
                              "not a CUDA device")
        self.buckets = Buckets(block=cache_block, exact=not (cuda_graphs or compile))
        self.runner = StepRunner(compile, cuda_graphs) if steppable else None
        self.state: StepState | None = None  # kept between calls under buckets (the graphs' addresses)
        self.captured_with: tuple[int, int] | None = None  # (stack binding, state id) the graphs read

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Refreshes the engine's own weights copy (weights_dtype) from the trainer's policy, in place."""
        if self.copy is not None:
            refresh_copy(self.copy, base_model(model))

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
        sampler = Sampler(greedy=params.greedy or params.temperature <= 0, temperature=float(params.temperature),
                          top_k=int(params.top_k), top_p=float(params.top_p), pad_token_id=self.pad_token_id)
        stepped = self.runner is not None
        positions = self.buckets.length(width + steps) if stepped else width + steps
        if stepped and self.state is not None and self.state.fits(rows, positions, self.state.is_stop.numel(), device):
            positions = self.state.positions  # the kept state's tables: the same tensors the graphs read
        self.forward.begin(positions)
        logits, prefill_cache = self._prefill(prefill_ids, prefill_mask, width if stepped else width + steps)
        if expand is not None:
            expand = expand.to(device)
            logits = logits[expand]
        state = self._step_state(rows, positions, logits.shape[-1], device)
        state.start(prefill_mask, expand, rows, seeds, steps, stops, sampler)
        if stepped:
            state.cache.load(prefill_cache, expand, rows)
            cache = None
        else:
            cache = prefill_cache
            if expand is not None:
                cache.batch_select_indices(expand)
        tokens, logprobs, finished = sample_next(logits, step_uniforms(state, rows, sampler), state.finished[:rows],
                                                 state.is_stop, self.pad_token_id, sampler.temperature,
                                                 sampler.top_k, sampler.top_p)
        live = torch.arange(rows, device=device)  # output row of each batch row
        out_tokens = torch.full((rows, steps), self.pad_token_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=device)
        used = steps
        for t in range(steps):
            n = live.numel()
            out_tokens[live, t] = tokens[:n]
            out_logprobs[live, t] = logprobs[:n]
            n_finished = int(finished[:n].sum())
            if t == steps - 1 or n_finished == n:
                used = t + 1
                break
            state.advance(tokens, finished)
            filled = width + t + 1  # cache columns after the next step writes its input token's keys
            if self.compaction and n_finished > self.compact_fraction * n:
                holes, sources, order = compaction_moves(finished[:n], n_finished)
                state.fill_holes(holes, sources, filled - 1)
                if cache is not None:
                    compact(cache, holes, sources, order)
                live = live[order]
                n = live.numel()
            if stepped:
                tokens, logprobs, finished = self.runner(self.forward, state, self.buckets.rows(n),
                                                         self.buckets.length(filled), sampler)
            else:
                tokens, logprobs, finished = cached_step(self.forward, cache, state, n, filled, sampler)
        if self.buckets.exact or not stepped:
            self.state = None  # eager decoding keeps no buffers between calls
        return out_tokens[:, :used].cpu(), out_logprobs[:, :used].cpu()

    def _prefill(self, ids, mask, capacity: int):
        """Last-position logits of the left-padded prompts and their cache (static: `capacity` positions)."""
        device = model_device(self.model)
        width = ids.shape[1]
        if self.cache_kind == "static":
            cache = Cache(layers=[SlotLayer(capacity) for _ in range(self.model.config.num_hidden_layers)])
        else:
            cache = new_dynamic_cache(self.model)
        valid = mask.to(device).bool()
        positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 0).to(device)
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        logits = self.forward.logits(ids.to(device), causal[None, None] & valid[:, None, None, :], positions, cache)
        return logits, cache

    def _step_state(self, rows: int, positions: int, vocab: int, device: torch.device) -> StepState:
        """The step's state: kept between calls under buckets while it fits (the captured graphs read it), else new;
        the graphs are dropped whenever the state or the stack's binding they read is not the one they captured."""
        stack = self.forward if self.runner is not None else None
        if self.state is None or not self.state.fits(rows, positions, vocab, device):
            self.state = StepState(self.buckets.rows(rows), positions, vocab, device, stack)
        if self.runner is not None:
            now = (self.forward.binding, id(self.state))
            if now != self.captured_with:
                self.runner.reset()
                self.captured_with = now
        return self.state


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def compute_copy(model: torch.nn.Module, dtype: torch.dtype | str | None) -> torch.nn.Module | None:
    """A copy of `model` whose parameters are in `dtype`, for sampling (None when they already are, or no dtype).
    Each parameter is cast straight into the copy (the model is never duplicated in its own dtype); buffers (the
    rotary frequencies) are copied as they are, as from_pretrained keeps them in float32 in any dtype."""
    if isinstance(dtype, str):  # as written in a config file
        dtype = getattr(torch, dtype, None) if dtype in DTYPE_NAMES else None
        if dtype is None:
            raise ConfigError(f"rollout.engine_options.weights_dtype: one of {', '.join(DTYPE_NAMES)}")
    if dtype is None or all(p.dtype == dtype for p in model.parameters()):
        return None
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:  # tied weights stay tied
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
    return copy.deepcopy(model, memo)


def refresh_copy(copy_: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copies `model`'s parameters into the copy's, in place, by name (rounded to the copy's dtype)."""
    sources = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in copy_.named_parameters():
            p.copy_(sources[name])
