"""How much of a generate call is per-step cost that does not depend on the batch: the built-in tiny model (the
model of `benchmarks/step_throughput.py`) generates 16 new tokens for 4 prompts at 1, 4, 16 and 64 rollouts each,
arms interleaved (benchmarks/timing.py), median of `--repeats` rounds.

A least-squares line through (rows, seconds) splits a call into a fixed part (the intercept: Python and per-op
dispatch of each decode step and reading every weight for the step's matmuls, paid at any batch size) and a
per-row part (matmul arithmetic and elementwise work). Also printed: ATen operations per call, the fixed part per
decode step, how much of it one step's matmuls take alone on 4 rows, and the matmul time a 64-row call needs at
this machine's GEMM rate (1024^3, measured in this run by update_speed.py's gemm_rate).

`--compile` adds a second arm: the fast engine's decoder-layer loop under `torch.compile(dynamic=True)`, with its
compile time (first call) and its steady times at the same batch sizes.

    python benchmarks/decode_overhead.py [--repeats 7] [--threads 1] [--compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import MIN_REPEATS, Spread, interleaved, machine_line  # noqa: E402
from benchmarks.update_speed import gemm_rate  # noqa: E402
from podsrl.config import TinyModelConfig  # noqa: E402
from podsrl.engines.base import SamplingParams  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help=f"interleaved rounds (>= {MIN_REPEATS})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--compile", action="store_true", help="also time the layer loop under torch.compile")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(machine_line())
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    engines = {"eager": FastEngine(model, tokenizer)}

    def call(engine: FastEngine, per: int):
        return engine.generate(prompts, [per] * len(prompts), params, torch.arange(len(prompts) * per))

    if opts.compile:
        compiled = FastEngine(model, tokenizer)
        compiled.forward.logits = torch.compile(compiled.forward.logits, dynamic=True)
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
