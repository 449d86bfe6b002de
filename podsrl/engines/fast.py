"""A hand-written decode loop that makes rollouts several times cheaper than `model.generate`.

Where the time goes in GRPO rollouts (many samples of few prompts, varied lengths) and what this loop does about it:
- shared-prompt prefill: each distinct prompt runs through the model once; its KV cache rows are index-expanded
  across its group instead of re-encoding the prompt counts[i] times;
- finished-row compaction: rows that emitted a stop token leave the batch (cache rows index-selected), so the cost
  of a step follows the live rows, not the longest one;
- waves: at most max_rows rows decode at once (each at its own cache column); the rows of waiting prompt groups
  are prefilled into the places finished rows leave, so a step larger than the device runs in its memory;
- a pre-allocated KV cache written in place (no per-step concatenation of the whole cache), attending only over the
  filled prefix;
- counter-based per-row sampling (see sampling.py): no multinomial, no global RNG, and a row's completion depends
  only on (weights, prompt, seed, params).
- on Llama/Mistral/Qwen2/Qwen3 models, the decoder stack driven layer by layer by podsrl/models/decode.py (q/k/v
  and gate/up each one matmul, few ops per layer; attention as grouped matmuls on the CPU, SDPA off it).
- on those models, each decode step one function of static shapes with no host synchronisation inside
  (decode_step.py): forward, sampling and stop flags; under `cuda_graphs` one CUDA graph per (rows, cache length)
  bucket is captured and replayed, so a step costs its kernels, not their launches.
- episodes (`session`, continuation.py): between turns each episode's KV cache stays on the device and the next
  turn's prefill computes only the columns its cached prefix lacks (`_prefill`); a row's cache is copied out when
  it finishes, before a later step or compaction overwrites it.
Masks and position ids are built here exactly as `generate` builds them, so greedy outputs equal `generate`'s (other
models run the model's own forward). A Llama-family model it cannot drive is an error naming the cause (see
models/transformers_api.check_fast_path); other models it cannot drive fall back to HFEngine, logged and recorded.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from typing import Any

import torch

from podsrl.engines.base import EpisodeSession, GenerationOutput, RolloutEngine, SamplingParams, left_pad
from podsrl.engines.continuation import CachedSession
from podsrl.engines.decode_step import Buckets, Sampler, StepRunner, StepState, cached_step, step_uniforms
from podsrl.engines.device_rows import plan_rows_in_flight
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
from podsrl.engines.weights_copy import compute_copy, refresh_copy
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
from podsrl.planning.workload import CACHE_BLOCK, EngineMemory, ModelShape, model_shape

logger = logging.getLogger("podsrl")
# Under buckets (CUDA graphs, compile) the host reads the finished rows and the top column every SYNC_EVERY steps,
# not every step: a read waits for the device, so between reads the GPU runs ahead of the Python loop. The price:
# rows that finished decode padding until the next read (compaction, refills and the call's end wait for it).
SYNC_EVERY = 8


class FastEngine(RolloutEngine):
    """Fast in-process sampler; see the module docstring.

    Options (rollout.engine_options):
    - shared_prefill (True), compaction (True), compact_fraction (0.0: compact as soon as one row finishes; f > 0:
      wait until a fraction f of the batch has finished);
    - layer_loop (True: drive the decoder layers of Llama/Mistral/Qwen2/Qwen3 models from their submodules, see the
      module docstring); cache ("static" pre-allocated buffers or "dynamic" transformers DynamicCache);
    - max_rows (None): rows decoded at once (the layer loop with the static cache); the rows of the other prompt
      groups wait in a queue and take the places of finished rows. None: on CUDA as many as the memory plan fits in
      the device's free memory (podsrl/planning/memory.py rows_in_flight), elsewhere all. The tokens do not depend on it;
    - cuda_graphs (None: on when the model is on a CUDA device and the layer loop runs with the static cache):
      capture one CUDA graph of the decode step per bucket and replay it. The engine then keeps its KV cache and
      step state between calls (max_rows rows, a power of two, positions to a multiple of cache_block) until
      `release`: the graphs replay at those addresses. The trainer keeps them through the update where the memory
      plan fits them (keeps_state_across_updates), and the graphs replay the new weights: the optimiser, sync_weights
      and DecodeStack.begin update the tensors they read in place;
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
    may_run_async = True
    compute_dtype_option = "weights_dtype"
    rows_option = "max_rows"

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
        cache_block: int = CACHE_BLOCK,
        weights_dtype: torch.dtype | str | None = None,
        max_rows: int | None = None,
        **options: Any,
    ) -> None:
        if cache not in ("static", "dynamic"):
            raise ValueError(f"FastEngine: cache must be 'static' or 'dynamic', got {cache!r}")
        if cache_block < 1:
            raise ConfigError(f"rollout.engine_options.cache_block: must be >= 1, got {cache_block}")
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
            raise ConfigError(f"rollout.engine_options.max_rows: an integer >= 1 (rows decoded at once), got "
                              f"{max_rows!r}")
        self.max_rows = max_rows
        self.shape: ModelShape | None = None  # the memory plan's view of the model, for the default max_rows
        self.planned_rows: int | None = None  # the run's plan's rows in flight (plan_rows), a bound on the default
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
        self.sessions: weakref.WeakSet[CachedSession] = weakref.WeakSet()  # open ones: `release` frees their caches
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

    @classmethod
    def keeps_decode_state(cls, options: dict, device: str) -> bool:
        """Its static-shape step under CUDA graphs (on by default on CUDA) or compiled keeps a state between calls."""
        buckets = bool(options.get("compile")) or (device == "cuda" and options.get("cuda_graphs") is not False)
        return bool(options.get("layer_loop", True) and options.get("cache", "static") == "static" and buckets)

    @classmethod
    def device_memory(cls, options: dict) -> EngineMemory:
        """A KV cache of its rows in flight, its positions in blocks of cache_block, and the fused weights."""
        return EngineMemory(cache_block=options.get("cache_block", CACHE_BLOCK))

    @property
    def keeps_state_across_updates(self) -> bool:
        """Under buckets (CUDA graphs or compile) the step state and graphs stay between calls."""
        return self.runner is not None and not self.buckets.exact

    @property
    def sampler(self) -> str:
        return self.name if self.fallback is None else self.fallback.name

    def plan_rows(self, rows: int) -> None:
        self.planned_rows = rows

    def generate(
        self,
        prompts: list[list[int]],
        counts: list[int],
        params: SamplingParams,
        seeds: torch.Tensor,
    ) -> GenerationOutput:
        if self.fallback is not None:
            return self.fallback.generate(prompts, counts, params, seeds)
        return self._generate(prompts, counts, params, seeds)[0]

    def session(self) -> EpisodeSession:
        """Episodes continue each row's KV cache between turns (continuation.py) on the static-shape step's path;
        the other paths (the model's own forward, the dynamic cache, the hf fallback) re-prefill each turn."""
        if self.runner is None:
            return super().session()
        session = CachedSession(self)
        self.sessions.add(session)
        return session

    def generate_keeping(self, contexts: list[list[int]], params: SamplingParams, seeds: torch.Tensor,
                         prefixes: list[torch.Tensor | None]) -> tuple[GenerationOutput, list[torch.Tensor | None]]:
        """One row per context, `prefixes[i]` the cached keys and values of a prefix of context i ([layers, 2,
        kv_heads, tokens, d], or None): the prefill computes only the rest. Also returns each row's cache after
        the call over its context and completion but the last token (None for a row that generated nothing)."""
        return self._generate(contexts, [1] * len(contexts), params, seeds, prefixes)

    def _generate(self, prompts: list[list[int]], counts: list[int], params: SamplingParams, seeds: torch.Tensor,
                  prefixes: list[torch.Tensor | None] | None = None):
        """(output, kept): kept is None, or with `prefixes` (one per prompt) each row's cache after the call."""
        rows = check_request(prompts, counts, seeds)
        if rows == 0 or params.max_new_tokens <= 0:
            output = no_token_output(prompts, counts, rows, self.pad_token_id, params.return_logprobs)
            return output, None if prefixes is None else [None] * rows
        group_index, prompt_ids, prompt_mask = row_prompts(prompts, counts, self.pad_token_id)
        stops = stop_ids(self.eos_ids, params)
        with torch.inference_mode(), eval_mode(self.model):
            tokens, logprobs, kept = self._decode(prompts, counts, rows, params, seeds, stops, prefixes)
        mask, truncated = completion_mask(tokens, stops)
        return GenerationOutput(
            group_index=group_index,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=tokens,
            completion_mask=mask,
            truncated=truncated,
            logprobs=logprobs * mask if params.return_logprobs else None,
        ), kept

    def release(self) -> None:
        """Frees what the engine keeps between calls (the step state and KV cache, the graphs that read them, open
        episode sessions' caches): the trainer calls it before the update where the memory plan does not fit them
        beside it, and after an eval there too (a session's next turn then prefills its episodes whole)."""
        for session in list(self.sessions):
            session.close()
        self.state = None
        self.captured_with = None
        if self.runner is not None:
            self.runner.reset()

    def _distinct_prompts(self, prompts: list[list[int]], counts: list[int]):
        """Left-padded distinct prompts, the row -> distinct prompt index that expands them to rows, and the first
        of `prompts` that is each distinct prompt."""
        slot: dict[tuple[int, ...], int] = {}
        distinct: list[list[int]] = []
        firsts: list[int] = []
        per_used: list[int] = []
        used_counts: list[int] = []
        for index, (prompt, count) in enumerate(zip(prompts, counts)):
            if count <= 0:
                continue
            key = tuple(prompt)
            if key not in slot:
                slot[key] = len(distinct)
                distinct.append(prompt)
                firsts.append(index)
            per_used.append(slot[key])
            used_counts.append(count)
        ids, mask = left_pad(distinct, self.pad_token_id)
        expand = torch.repeat_interleave(torch.tensor(per_used), torch.tensor(used_counts))
        return ids, mask, expand, firsts

    def _decode(self, prompts: list[list[int]], counts: list[int], rows: int, params: SamplingParams, seeds,
                stops: list[int], prefixes: list[torch.Tensor | None] | None = None):
        """Tokens [R, Lc] (pad after a row's stop), sampled-token log-probs [R, Lc] and, with `prefixes` (cached
        keys and values per prompt, see generate_keeping), each row's cache when it finished (else None), decoded
        in waves: at most `rows_in_flight` rows at once, the rows freed by finished completions refilled from the
        queue of waiting prompt groups (each row's tokens depend only on its prompt, seed and the weights, not on
        its wave). Sessions are offered on the stepped path only (`session`), where the cache is `state.cache`."""
        device = model_device(self.model)
        steps = params.max_new_tokens
        sampler = Sampler(greedy=params.greedy or params.temperature <= 0, temperature=float(params.temperature),
                          top_k=int(params.top_k), top_p=float(params.top_p), pad_token_id=self.pad_token_id)
        stepped = self.runner is not None
        width = max(len(p) for p, c in zip(prompts, counts) if c > 0)
        positions = self.buckets.length(width + steps) if stepped else width + steps
        limit = self.rows_in_flight(prompts, counts, steps, params.top_p) if stepped else rows
        if stepped and self.state is not None and self.state.fits(limit, positions, self.state.is_stop.numel(), device):
            positions = self.state.positions  # the kept state's tables: the same tensors the graphs read
        self.forward.begin(positions)
        queue = deque(_pieces(prompts, counts, limit, prefixes))
        kept = None if prefixes is None else [None] * rows
        state = cache = None
        live = emitted = tokens = torch.zeros(0, dtype=torch.long, device=device)
        logprobs = torch.zeros(0, dtype=torch.float32, device=device)
        finished = was_finished = torch.zeros(0, dtype=torch.bool, device=device)
        out_tokens = torch.full((rows, steps + 1), self.pad_token_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros((rows, steps + 1), dtype=torch.float32, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        n = top = since = 0  # live rows; the largest column among them (a bound); steps since the host read them
        while True:
            if n == 0:  # every row finished: the next wave starts from the queue
                step = (tokens, logprobs, finished)
            elif stepped:
                length = self.buckets.length(min(top + 2, state.positions))
                step = self.runner(self.forward, state, self.buckets.rows(n), length, sampler)
            else:
                step = cached_step(self.forward, cache, state, n, top + 2, sampler)
            tokens, logprobs, finished = (t[:n] for t in step)
            admitted = []
            while queue and n + sum(piece[2] for piece in admitted) + queue[0][2] <= limit:
                admitted.append(queue.popleft())
            if admitted:
                logits, prefill_cache, mask, expand, out_rows = self._prefill_pieces(admitted, steps, stepped, device)
                if state is None:
                    state = self._step_state(limit, positions, logits.shape[-1], device)
                    state.begin(stops)
                k = out_rows.numel()
                state.admit(n, mask, expand, k, seeds[out_rows.cpu()], steps, sampler)
                if stepped:
                    state.cache.load(prefill_cache, expand, k, n)
                else:  # one admission (limit = rows): the prefill's cache is the decode cache
                    cache = prefill_cache
                    if expand is not None:
                        cache.batch_select_indices(expand)
                new = sample_next(logits, step_uniforms(state, k, sampler, n), state.finished[n : n + k],
                                  state.is_stop, self.pad_token_id, sampler.temperature, sampler.top_k, sampler.top_p)
                tokens, logprobs, finished = (torch.cat([old, more]) for old, more in zip((tokens, logprobs, finished),
                                                                                         new))
                live = torch.cat([live, out_rows])
                emitted = torch.cat([emitted, torch.zeros(k, dtype=torch.long, device=device)])
                was_finished = torch.cat([was_finished, torch.zeros(k, dtype=torch.bool, device=device)])
                n += k
            out_tokens[live, emitted] = tokens
            out_logprobs[live, emitted] = logprobs
            emitted = emitted + ~was_finished  # a finished row's padding lands one past its stop token
            lengths[live] = emitted
            finished = finished | (emitted >= steps)
            if kept is not None:  # before a later step overwrites its last column, or compaction its row
                _keep_finished(state, finished & ~was_finished, live, kept)
            if self.buckets.exact or not stepped or kept is not None or admitted or since + 1 >= SYNC_EVERY:
                n_finished, top = (int(x) for x in torch.stack([finished.sum(), state.column[:n].max()]).tolist())
                since = 0
            else:  # no host sync: a column moves at most one a step, finished rows decode padding until the next read
                n_finished, top, since = 0, top + 1, since + 1
            if n_finished == n and not queue:
                break
            state.advance(tokens, finished)
            was_finished = finished
            if n_finished and (queue or (self.compaction and n_finished > self.compact_fraction * n)):
                holes, sources, order = compaction_moves(finished, n_finished)
                state.fill_holes(holes, sources, top + 1)
                if cache is not None:
                    compact(cache, holes, sources, order)
                live, emitted, was_finished = live[order], emitted[order], was_finished[order]
                n = live.numel()
        if self.buckets.exact or not stepped:
            self.state = None  # eager decoding keeps no buffers between calls
        used = int(lengths.max())
        return out_tokens[:, :used].cpu(), out_logprobs[:, :used].cpu(), kept

    def rows_in_flight(self, prompts: list[list[int]], counts: list[int], steps: int, top_p: float) -> int:
        """How many rows decode at once: rollout.engine_options.max_rows, else on CUDA as many as the memory plan
        says fit the device's free memory (less its reserve), and no more than the run's plan counted beside the
        update (`plan_rows`: free memory at the first call does not hold the optimiser's state and gradients yet),
        else all. Under buckets the state's rows are the bucket's (a power of two), kept within the budget."""
        rows = sum(counts)
        budget = self.max_rows
        if budget is None and model_device(self.model).type == "cuda":
            if self.shape is None:
                self.shape = model_shape(self.model.config)
            kept = self.state.nbytes if self.state is not None else 0
            budget = plan_rows_in_flight(self.model, self.shape, prompts, counts, steps, top_p, kept)
            budget = min(budget, self.planned_rows or budget)
        if budget is None:
            return rows
        limit = max(1, min(rows, budget))
        if self.buckets.rows(limit) > budget:  # the state holds a bucket's rows: no more than the budget
            limit = 1 << (limit.bit_length() - 1)
        return limit

    def _prefill_pieces(self, pieces, steps: int, stepped: bool, device):
        """Prefill of the pieces' prompts: (logits [rows, V], cache, prompt mask, expand (cache row of each row, or
        None), output rows [rows])."""
        prompts, counts = [p for p, _, _, _ in pieces], [c for _, _, c, _ in pieces]
        prefixes = [prefix for _, _, _, prefix in pieces]
        out_rows = torch.cat([torch.arange(start, start + c) for _, start, c, _ in pieces]).to(device)
        if self.shared_prefill:
            ids, mask, expand, firsts = self._distinct_prompts(prompts, counts)
            prefixes = [prefixes[i] for i in firsts]
        else:
            ids, mask = left_pad([p for p, c in zip(prompts, counts) for _ in range(c)], self.pad_token_id)
            prefixes = [prefix for prefix, c in zip(prefixes, counts) for _ in range(c)]
            expand = None
        width = ids.shape[1]
        logits, cache = self._prefill(ids, mask, width if stepped else width + steps, prefixes)
        if expand is not None:
            expand = expand.to(device)
            logits = logits[expand]
        return logits, cache, mask, expand, out_rows

    def _prefill(self, ids, mask, capacity: int, prefixes: list[torch.Tensor | None]):
        """Last-position logits of the left-padded prompts and their cache (static: `capacity` positions). Where
        `prefixes` (per prompt, see generate_keeping) cover every prompt but its last `block` tokens, the cache
        starts with their keys and values and only those last columns run through the model (`block` the most
        tokens any prompt's prefix lacks: a prompt with fewer recomputes some cached ones, as its padding would)."""
        device = model_device(self.model)
        width = ids.shape[1]
        if self.cache_kind == "static":
            cache = Cache(layers=[SlotLayer(capacity) for _ in range(self.model.config.num_hidden_layers)])
        else:
            cache = new_dynamic_cache(self.model)
        start = _cached_columns(cache, mask, prefixes)
        valid = mask.to(device).bool()
        positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 0).to(device)
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        allowed = (causal[None, None] & valid[:, None, None, :])[:, :, start:]
        logits = self.forward.logits(ids[:, start:].to(device), allowed, positions[:, start:], cache)
        return logits, cache

    def _step_state(self, rows: int, positions: int, vocab: int, device: torch.device) -> StepState:
        """The step's state: kept between calls under buckets while it fits (the captured graphs read it), else new;
        the graphs are dropped whenever the state or the stack's binding they read is not the one they captured."""
        stack = self.forward if self.runner is not None else None
        if self.state is None or not self.state.fits(rows, positions, vocab, device):
            self.release()  # the old state's memory is free before the new one is allocated
            self.state = StepState(self.buckets.rows(rows), positions, vocab, device, stack)
        if self.runner is not None:
            now = (self.forward.binding, id(self.state))
            if now != self.captured_with:
                self.runner.reset()
                self.captured_with = now
        return self.state


def _pieces(prompts: list[list[int]], counts: list[int], limit: int, prefixes: list | None) -> list[tuple]:
    """The queue of a generate call: (prompt, first output row, rows, the prompt's cached prefix or None) per
    prompt group, a group of more than `limit` rows split into pieces of at most `limit` (a piece is admitted
    whole: its rows share a prefill)."""
    pieces, start = [], 0
    for index, (prompt, count) in enumerate(zip(prompts, counts)):
        prefix = None if prefixes is None else prefixes[index]
        for offset in range(0, count, limit):
            pieces.append((prompt, start + offset, min(limit, count - offset), prefix))
        start += count
    return pieces


def _cached_columns(cache, mask: torch.Tensor, prefixes: list[torch.Tensor | None]) -> int:
    """Loads the columns of the left-padded prompts (`mask` [P, width]) that every prompt's cached prefix covers
    into `cache` (static), and returns how many that is: width less the most tokens a prefix lacks (0: none)."""
    lengths = mask.sum(1).tolist()
    lacking = [n - (0 if kv is None else kv.shape[3]) for n, kv in zip(lengths, prefixes)]
    start = mask.shape[1] - max(lacking, default=0)
    if start <= 0:
        return 0
    reference = next(kv for kv in prefixes if kv is not None)
    layers, _, heads, _, dim = reference.shape
    columns = reference.new_zeros((layers, 2, len(lengths), heads, start, dim))
    for row, (n, kv) in enumerate(zip(lengths, prefixes)):
        cached = n - (mask.shape[1] - start)  # this prompt's tokens before the computed block
        if cached > 0:
            columns[:, :, row, :, start - cached :] = kv[:, :, :, :cached]
    for layer, (keys, values) in zip(cache.layers, columns):
        layer.hold(keys, values)
    return start


def _keep_finished(state: StepState, newly: torch.Tensor, live: torch.Tensor, kept: list) -> None:
    """Copies out the cache of each row that finished at this step (`newly` over the batch rows): its columns from
    its left padding through the one this step wrote (its context and its tokens but the last), into
    kept[its output row]."""
    rows = newly.nonzero().squeeze(1)
    for row, column, pad, out_row in zip(*(t.tolist() for t in (rows, state.column[rows], state.left_pad[rows],
                                                                 live[rows]))):
        kept[out_row] = state.cache.columns(row, pad, column + 1)
