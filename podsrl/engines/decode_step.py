"""The fast engine's decode step at static shapes, and how it runs: eagerly, compiled, or replayed as CUDA graphs.

On a GPU a decode step is a chain of small kernels per layer: launches, not work, set its rate. Serving engines
replay CUDA graphs of a static-shape step instead; this module gives the step those shapes:
- the batch rows in power-of-two buckets and the cache read up to the filled length rounded up to a multiple of a
  block (`Buckets`); a bucket's rows past the live ones compute padding that nobody reads;
- every per-row input in tensors of fixed shape and address (`StepState`): the last tokens, each row's left padding
  (a token's position is its cache column minus it), key validity, the uniforms of every position, the finished
  flags, the cache column each row writes next and the stop tokens (a vocabulary lookup);
- no host synchronisation inside: a step is the forward, the sampling (top-k/top-p exact, sampling.sample_next) and
  the finished flags; compaction and the bucket choice happen between steps (fast.py).
`decode_step` is a pure function of the state but for its one write, the step's keys and values at the state's
column: a CUDA graph's warm-up run and its replay write the same values, and the loop advances the state itself.
Models the stack cannot drive, and the dynamic cache, step through transformers' cache interface (`cached_step`,
eager and exact shapes only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from podsrl.engines.capture_lock import CAPTURE_LOCK
from podsrl.engines.sampling import row_uniforms, sample_next
from podsrl.models.decode import DecodeStack
from podsrl.models.static_cache import StepCache
from podsrl.planning.workload import CACHE_BLOCK

RECOMPILE_LIMIT = 1024  # compiled steps per code object: one per bucket visited (torch's default stops at 8)


class Sampler(NamedTuple):
    """The sampling constants of a generate call: part of a compiled step's or captured graph's key."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    pad_token_id: int


@dataclass(frozen=True)
class Buckets:
    """The step's static shapes: batch rows rounded up to a power of two, the cache read up to the filled length
    rounded up to a multiple of `block`; `exact` keeps the live shapes (eager decoding: no padded work)."""

    block: int = CACHE_BLOCK
    exact: bool = False

    def rows(self, live: int) -> int:
        return live if self.exact else 1 << (live - 1).bit_length()

    def length(self, filled: int) -> int:
        return filled if self.exact else -(-filled // self.block) * self.block


class StepState:
    """The step's per-row inputs for up to `rows` rows and `positions` cache columns, at fixed addresses (see the
    module docstring); with a `StepCache` when the stack is given (else the caller keeps a transformers cache)."""

    def __init__(self, rows: int, positions: int, vocab: int, device: torch.device,
                 stack: DecodeStack | None = None) -> None:
        self.rows, self.positions = rows, positions
        self.cache = None
        if stack is not None:
            dtype = stack.body.embed_tokens.weight.dtype
            self.cache = StepCache(len(stack.layers), rows, positions, stack.kv_heads, stack.head_dim, dtype, device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # each row's last token
        self.left_pad = torch.zeros(rows, dtype=torch.long, device=device)
        self.valid = torch.ones((rows, positions), dtype=torch.bool, device=device)  # keys a row may attend
        # the uniform of the token sampled from the logits at each column, float64 as the sampler's CDF (a float32
        # uniform near 1 has steps of 6e-8: tail tokens under it would be hit with their mass rounded)
        self.uniforms = torch.zeros((rows, positions), dtype=torch.float64, device=device)
        self.finished = torch.ones(rows, dtype=torch.bool, device=device)
        self.column = torch.zeros(rows, dtype=torch.long, device=device)  # the column each row's next step writes
        self.is_stop = torch.zeros(vocab, dtype=torch.bool, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of the state's tensors, its cache included."""
        tensors = [self.tokens, self.left_pad, self.valid, self.uniforms, self.finished, self.column, self.is_stop]
        if self.cache is not None:
            tensors += self.cache.buffers
        return sum(t.numel() * t.element_size() for t in tensors)

    def fits(self, rows: int, positions: int, vocab: int, device: torch.device) -> bool:
        return (rows <= self.rows and positions <= self.positions and vocab == self.is_stop.numel()
                and device == self.tokens.device)

    def begin(self, stops: list[int]) -> None:
        """A generate call's start: no row admitted yet. Rows never admitted are a bucket's padding: an earlier
        call's values there (a left padding wider than a column: a negative position) must not index out of range."""
        self.left_pad.zero_()
        self.column.zero_()
        self.finished.fill_(True)
        self.is_stop.zero_()
        self.is_stop[torch.tensor(stops, dtype=torch.long, device=self.tokens.device)] = True

    def admit(self, start: int, prefill_mask: Tensor, expand: Tensor | None, rows: int, seeds: Tensor, steps: int,
              sampler: Sampler) -> None:
        """Sets up rows [start:start + rows] after the prefill of `prefill_mask` [P, width] (`expand`: prefill row of
        each row); each row's column is its own, so rows admitted later decode beside earlier ones."""
        device, width, end = self.tokens.device, prefill_mask.shape[1], start + rows
        mask = prefill_mask.to(device).bool()
        if expand is not None:
            mask = mask[expand]
        self.valid[start:end, :width] = mask
        self.valid[start:end, width:] = True  # generated positions are always valid; a step reads up to its column
        self.left_pad[start:end] = width - mask.sum(1)
        if not sampler.greedy:  # every position's uniform hashed at once, not one hash per step
            positions = torch.arange(steps, device=device)[None]
            self.uniforms[start:end, width - 1 : width - 1 + steps] = row_uniforms(
                seeds.long().to(device)[:, None], positions)
        self.finished[start:end] = False
        self.column[start:end] = width - 1  # the prefill's last column: its logits give the first token

    def advance(self, tokens: Tensor, finished: Tensor) -> None:
        """After a step over the leading rows: its tokens are the next step's input, one column on for the rows
        still decoding (a finished row stays put: it never writes past its last column)."""
        rows = tokens.numel()
        self.tokens[:rows].copy_(tokens)
        self.finished[:rows].copy_(finished)
        self.column[:rows] += ~finished

    def fill_holes(self, holes: Tensor, sources: Tensor, filled: int) -> None:
        """Rows `sources` into rows `holes` (static_cache.compaction_moves), the cache's first `filled` columns."""
        if self.cache is not None:
            self.cache.fill_holes(holes, sources, filled)
        for row_tensor in (self.tokens, self.left_pad, self.valid, self.uniforms, self.finished, self.column):
            row_tensor[holes] = row_tensor[sources]


def decode_step(stack: DecodeStack, state: StepState, rows: int, length: int,
                sampler: Sampler) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, log-probs, finished) [rows] of the next position: the forward of rows [:rows] of the state's last
    tokens, attending over cache columns [:length] up to the one it writes, then sample_next. Static shapes for
    static (rows, length, sampler); no host synchronisation."""
    column = state.column[:rows]
    allowed = state.valid[:rows, :length] & (torch.arange(length, device=column.device) <= column[:, None])
    positions = column - state.left_pad[:rows]
    cache, written = state.cache, torch.arange(rows, device=column.device)
    logits = stack.forward(state.tokens[:rows, None], allowed[:, None, None], positions[:, None],
                           lambda index, kv: cache.write(index, kv, written, column, length))
    return sample_next(logits, step_uniforms(state, rows, sampler), state.finished[:rows], state.is_stop,
                       sampler.pad_token_id, sampler.temperature, sampler.top_k, sampler.top_p)


def step_uniforms(state: StepState, rows: int, sampler: Sampler, start: int = 0) -> Tensor | None:
    """Rows [start:start + rows]' uniforms at their columns (None: greedy)."""
    if sampler.greedy:
        return None
    end = start + rows
    return state.uniforms[start:end].gather(1, state.column[start:end, None])[:, 0]


def cached_step(forward, cache, state: StepState, rows: int, filled: int,
                sampler: Sampler) -> tuple[Tensor, Tensor, Tensor]:
    """`decode_step` through a transformers cache (models the stack cannot drive, the dynamic cache): eager, exact
    shapes, the cache appended to by `forward.logits`; `filled` columns after its write."""
    logits = forward.logits(state.tokens[:rows, None], state.valid[:rows, None, None, :filled],
                            (state.column[:rows] - state.left_pad[:rows])[:, None], cache)
    return sample_next(logits, step_uniforms(state, rows, sampler), state.finished[:rows], state.is_stop,
                       sampler.pad_token_id, sampler.temperature, sampler.top_k, sampler.top_p)


class StepRunner:
    """Runs `decode_step` at a bucket: eagerly; under torch.compile(fullgraph=True, dynamic=False) (`compile`: True
    for inductor, or a backend's name), one compilation per bucket; or (`cuda_graphs`) replaying a CUDA graph
    captured per bucket, of the eager or the compiled step. `visited` records the keys run."""

    def __init__(self, compile: bool | str = False, cuda_graphs: bool = False) -> None:
        self.compiled = bool(compile)
        self.step = decode_step
        if compile:
            backend = "inductor" if compile is True else compile
            self.step = torch.compile(decode_step, fullgraph=True, dynamic=False, backend=backend)
        self.graphs = CudaGraphs() if cuda_graphs else None
        self.visited: set[tuple[int, int, Sampler]] = set()

    def __call__(self, stack: DecodeStack, state: StepState, rows: int, length: int,
                 sampler: Sampler) -> tuple[Tensor, Tensor, Tensor]:
        key = (rows, length, sampler)
        self.visited.add(key)

        def run():
            if not self.compiled:
                return self.step(stack, state, rows, length, sampler)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                            accumulated_recompile_limit=RECOMPILE_LIMIT):
                return self.step(stack, state, rows, length, sampler)

        return run() if self.graphs is None else self.graphs.run(key, run)

    def reset(self) -> None:
        """Drops the captured graphs (the tensors they read were reallocated)."""
        if self.graphs is not None:
            self.graphs.clear()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The process's one side stream per device for graph warm-ups and captures (under CAPTURE_LOCK). cuBLAS keeps a
    workspace per (handle, stream) for the process's life (33 MiB on an H200): a fresh stream per capture would leave
    one behind per capture, up to the stream pool's 32, where one stream keeps one (memory_plan's RUNTIME_BYTES)."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


class CudaGraphs:
    """One CUDA graph per key, captured on first use and replayed after, all in one memory pool (they run one at a
    time). A graph reads and writes the addresses it captured: the state, the cache, the weights and rotary table of
    one stack binding; whoever reallocates any of them calls `clear`. The outputs are the graph's own tensors,
    overwritten by its next replay. A capture holds the process's CAPTURE_LOCK (no other device work beside it)."""

    def __init__(self) -> None:
        self.graphs: dict = {}
        self.pool = None

    def run(self, key, step) -> tuple[Tensor, ...]:
        if key not in self.graphs:
            with CAPTURE_LOCK:
                self.graphs[key] = self._capture(step)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def _capture(self, step):
        # a warm-up run on the side stream first (lazy cuBLAS/kernel set-up must not happen while capturing); its one
        # side effect, this step's keys and values at the state's column, the replay writes again before reading
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            outputs = step()
        self.pool = graph.pool()
        return graph, outputs

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None
