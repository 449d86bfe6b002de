"""How much of a generate call is per-step cost that does not depend on the batch: the built-in tiny model (the
model of `benchmarks/step_throughput.py`) generates 16 new tokens for 4 prompts at 1, 4, 16 and 64 rollouts each,
arms interleaved (benchmarks/timing.py), median of `--repeats` rounds.

A least-squares line through (rows, seconds) splits a call into a fixed part (the intercept: Python and per-op
dispatch of each decode step and reading every weight for the step's matmuls, paid at any batch size) and a
per-row part (matmul arithmetic and elementwise work). Also printed: ATen operations per call, the fixed part per
decode step, how much of it one step's matmuls take alone on 4 rows, and the matmul time a 64-row call needs at
this machine's GEMM rate (1024^3, measured in this run by update_speed.py's gemm_rate).

`--compile` adds a second arm: the fast engine with its decode step under torch.compile (engine option `compile`:
fullgraph, static shapes, one compilation per bucket), with its compile time (first call) and its steady times.

`--step` times the decode step alone instead, eager against compiled (inductor), at one (rows, cache length) bucket:
the built-in model and the GSM8K-shaped ~13M Qwen2 (benchmarks/gsm8k_shape.py), `--rows` 16 and 64, the cache
filled to `--filled` columns (prompt plus generated), arms interleaved, median and range of `--repeats` rounds of
`--calls` steps each.

    python benchmarks/decode_overhead.py [--repeats 7] [--threads 1] [--compile]
    python benchmarks/decode_overhead.py --step [--models builtin gsm8k] [--rows 16 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import MIN_REPEATS, Spread, interleaved, load_average, machine_line  # noqa: E402
from benchmarks.update_speed import gemm_rate  # noqa: E402
from podsrl.config import TinyModelConfig  # noqa: E402
from podsrl.engines.base import SamplingParams  # noqa: E402
from podsrl.engines.decode_step import Sampler, StepState  # noqa: E402
from podsrl.engines.fast import FastEngine  # noqa: E402
from podsrl.models.loading import build_char_tokenizer, build_tiny_model  # noqa: E402

PROMPTS = ("12+13=", "20+31=", "33+14=", "25+16=")
PER_PROMPT = (1, 4, 16, 64)
NEW_TOKENS = 16


def step_matmuls(model: torch.nn.Module, rows: int, repeats: int = 200) -> float:
    """Seconds of one decode step's matmuls alone (every Linear of the model, each on a [rows, in] input, cycled
    in model order as a step runs them): the part of the fixed cost that reading the weights sets."""
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def step() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    for _ in range(10):
        step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def op_count(call) -> int:
    """Top-level ATen operations of one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return sum(1 for e in prof.events() if e.cpu_parent is None)


def fit(rows: list[int], seconds: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line."""
    n = len(rows)
    mx, my = sum(rows) / n, sum(seconds) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(rows, seconds)) / sum((x - mx) ** 2 for x in rows)
    return my - slope * mx, slope


def builtin_model() -> torch.nn.Module:
    tokenizer = build_char_tokenizer()
    return build_tiny_model(TinyModelConfig(), tokenizer)


def gsm8k_shaped_model() -> torch.nn.Module:
    from benchmarks.gsm8k_shape import gsm8k_model

    return gsm8k_model().eval()


# name: (model builder, default filled cache columns: the workload's prompt plus some generated tokens)
STEP_MODELS = {"builtin": (builtin_model, 32), "gsm8k": (gsm8k_shaped_model, 256)}


def step_call(model: torch.nn.Module, rows: int, filled: int, compile: bool | str) -> Callable[[], object]:
    """One decode step of `rows` rows over `filled` cache columns, the engine's step at that bucket (eager, or
    compiled with `compile`'s backend), on a step state set up as after a prefill of `filled - 1` prompt tokens
    (the cache's contents do not change the work). Repeated calls rewrite the same column."""
    engine = FastEngine(model, compile=compile, cache_block=filled)
    stack, vocab = engine.forward, model.get_output_embeddings().weight.shape[0]
    sampler = Sampler(greedy=False, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    stack.begin(filled)
    state = StepState(rows, filled, vocab, torch.device("cpu"), stack)
    state.begin([1])
    state.admit(0, torch.ones(1, filled - 1, dtype=torch.long), torch.zeros(rows, dtype=torch.long), rows,
                torch.arange(rows), 1, sampler)
    state.advance(torch.randint(2, vocab, (rows,)), torch.zeros(rows, dtype=torch.bool))

    def call():
        with torch.inference_mode():
            return engine.runner(stack, state, rows, filled, sampler)

    return call


def step_table(opts) -> None:
    """Eager vs compiled decode step per model and batch rows (module docstring)."""
    print(f"decode step alone: eager vs torch.compile({opts.backend}, fullgraph, static shapes); median [range] over "
          f"{opts.repeats} interleaved rounds of {opts.calls} steps, ms a step")
    for name in opts.models:
        build, default_filled = STEP_MODELS[name]
        model = build()
        filled = opts.filled or default_filled
        params = sum(p.numel() for p in model.parameters())
        for rows in opts.rows:
            steps = {"eager": step_call(model, rows, filled, False),
                     "compiled": step_call(model, rows, filled, opts.backend)}
            start = time.perf_counter()
            steps["compiled"]()
            compile_s = time.perf_counter() - start

            def repeat(step):
                return lambda: [step() for _ in range(opts.calls)]

            times = interleaved({arm: repeat(step) for arm, step in steps.items()}, opts.repeats, warmup=1)
            eager, compiled = (Spread.of([t / opts.calls for t in times[arm]]) for arm in ("eager", "compiled"))
            speedup = Spread.of([e / c for e, c in zip(times["eager"], times["compiled"])])
            print(f"  {name} ({params / 1e6:.1f}M), {rows} rows, {filled} columns: eager {eager.text(1e3, 2, ' ms')}"
                  f", compiled {compiled.text(1e3, 2, ' ms')}, eager/compiled {speedup.text(1, 2, 'x')} "
                  f"(compilation {compile_s:.0f} s)", flush=True)
    print(f"load average after: {load_average()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help=f"interleaved rounds (>= {MIN_REPEATS})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--compile", action="store_true", help="also time the engine with its step compiled")
    parser.add_argument("--step", action="store_true", help="time the decode step alone, eager vs compiled")
    parser.add_argument("--models", nargs="+", default=list(STEP_MODELS), choices=list(STEP_MODELS),
                        help="--step: models")
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 64], help="--step: batch rows")
    parser.add_argument("--filled", type=int, default=0,
                        help="--step: cache columns filled (0: 32 for builtin, 256 for gsm8k)")
    parser.add_argument("--calls", type=int, default=20, help="--step: steps per timed round")
    parser.add_argument("--backend", default="inductor", help="--step: torch.compile backend")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(machine_line())
    if opts.step:
        step_table(opts)
        return
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    engines = {"eager": FastEngine(model, tokenizer)}

    def call(engine: FastEngine, per: int):
        return engine.generate(prompts, [per] * len(prompts), params, torch.arange(len(prompts) * per))

    if opts.compile:
        compiled = FastEngine(model, tokenizer, compile=True)
        start = time.perf_counter()
        call(compiled, PER_PROMPT[1])
        print(f"torch.compile: first call (compilation) {time.perf_counter() - start:.1f} s")
        engines["compiled"] = compiled
    arms = {(name, per): (lambda e=engine, p=per: call(e, p)) for name, engine in engines.items()
            for per in PER_PROMPT}
    times = interleaved(arms, opts.repeats, warmup=1)
    rows = [len(prompts) * per for per in PER_PROMPT]
    print(f"generate, {NEW_TOKENS} new tokens, {len(prompts)} prompts; median [range] over {opts.repeats} rounds")
    fixed_parts = {}
    for name in engines:
        medians = [Spread.of(times[(name, per)]).median for per in PER_PROMPT]
        print(f"  {name}: " + "  ".join(f"{r} rows {Spread.of(times[(name, per)]).text(1e3, 1, ' ms')}"
                                        for r, per in zip(rows, PER_PROMPT)))
        fixed_parts[name], per_row = fit(rows, medians)
        print(f"    fit: fixed {fixed_parts[name] * 1e3:.1f} ms a call + {per_row * 1e6:.0f} us a row; the fixed part "
              f"is {fixed_parts[name] / medians[2]:.0%} of the 64-row call")
    ops = op_count(lambda: call(engines["eager"], PER_PROMPT[0]))
    fixed = fixed_parts["eager"]
    matmuls = step_matmuls(model, len(prompts))
    print(f"  eager: {ops} ATen operations a call ({ops / NEW_TOKENS:.0f} a decode step): "
          f"{fixed / NEW_TOKENS * 1e3:.2f} ms fixed a step, of which the step's matmuls on {len(prompts)} rows "
          f"take {matmuls * 1e3:.2f} ms; the rest is {(fixed / NEW_TOKENS - matmuls) / (ops / NEW_TOKENS) * 1e6:.1f}"
          f" us an operation")
    config = model.config
    per_token = 2 * sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    flops = per_token * 64 * NEW_TOKENS
    rate = gemm_rate("cpu")
    print(f"  64 rows x {NEW_TOKENS} tokens: {flops / 1e9:.2f} GFLOP of matmuls (layers {config.num_hidden_layers},"
          f" width {config.hidden_size}), {flops / rate * 1e3:.1f} ms at this machine's GEMM rate "
          f"({rate / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
