"""Rollout throughput: FastEngine vs HFEngine (transformers `model.generate`), side by side in one run.

For each model and (prompts, n) the two engines generate the same request in interleaved rounds (benchmarks/
timing.py), `--repeats` (>= 5) rounds after an untimed warm-up call each: rates from the median round, the speed-up
as the median and range of the per-round ratios. Completions stop at EOS at varied lengths: the output head gets a bias on the EOS logit,
log((V - 1) / 7), so that under the near-uniform random-init distribution P(EOS) ~ 1/8 per step (mean completion
~6 of 16 tokens, geometric spread). Achieved FLOP/s counts the useful work, 2 * (non-embedding params) * (prompt +
completion tokens, each distinct prompt counted once), the same for both engines, and is shown as a share of the machine's fp32
GEMM peak measured in this run (2048^3 matmul).

    python benchmarks/generation.py                 # both models, all four (prompts, n), ~8 minutes
    python benchmarks/generation.py --models tiny --repeats 7
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.timing import MIN_REPEATS, interleaved, load_average, machine_line, ratio
from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.engines.hf import HFEngine

EOS, PAD, VOCAB = 1, 0, 100
MODELS = {  # name: (layers, hidden, intermediate, heads, kv heads)
    "tiny": (2, 128, 512, 4, 2),
    "small": (6, 384, 1024, 6, 2),
}
SHAPES = [(8, 16), (8, 64), (64, 16), (64, 64)]


class Tok:
    eos_token_id = EOS
    pad_token_id = PAD


def build_model(name: str) -> tuple[torch.nn.Module, int]:
    layers, hidden, inter, heads, kv = MODELS[name]
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
        eos_token_id=EOS, pad_token_id=PAD,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    bias = torch.zeros(VOCAB)
    bias[EOS] = math.log((VOCAB - 1) / 7)
    model.lm_head.bias = torch.nn.Parameter(bias)
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return model, matmul_params


def gemm_peak(size: int = 2048, repeats: int = 3) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_shape(
    engines: dict,
    prompts: list[list[int]],
    n: int,
    repeats: int,
    params: SamplingParams,
) -> dict:
    """Per engine: (seconds of each interleaved round, the output). The untimed first call of each engine is the
    warm-up and gives the output (fixed per-row seeds: every call generates the same rollouts)."""
    counts, seeds = [n] * len(prompts), torch.arange(len(prompts) * n)
    outputs = {name: engine.generate(prompts, counts, params, seeds) for name, engine in engines.items()}
    times = interleaved(
        {name: (lambda e=engine: e.generate(prompts, counts, params, seeds)) for name, engine in engines.items()},
        repeats,
        warmup=0,
    )
    return {name: (times[name], outputs[name]) for name in engines}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved rounds (median, range)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 = steadier on a shared machine)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=10)
    parser.add_argument(
        "--ablate", action="store_true", help="also time FastEngine variants at (8, 64), (64, 64)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    peak = gemm_peak()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for name in args.models:
        model, matmul_params = build_model(name)
        print(f"model {name}: {matmul_params / 1e6:.2f}M non-embedding params, {VOCAB} vocab", flush=True)
        engines = {"hf": HFEngine(model, Tok()), "fast": FastEngine(model, Tok())}
        for num_prompts, n in SHAPES:
            peak = max(
                peak, gemm_peak()
            )  # re-measured often: on a shared machine the best figure is the peak
            lengths = torch.randint(args.prompt_len - 2, args.prompt_len + 3, (num_prompts,), generator=gen)
            prompts = [torch.randint(2, VOCAB, (int(k),), generator=gen).tolist() for k in lengths]
            result = run_shape(engines, prompts, n, args.repeats, params)
            row = {"model": name, "P": num_prompts, "n": n}
            for engine_name in ("hf", "fast"):
                times, out = result[engine_name]
                seconds = statistics.median(times)
                generated = float(out.completion_mask.sum())
                useful = generated + float(sum(len(p) for p in prompts))  # each prompt encoded once
                row[engine_name] = (
                    num_prompts * n / seconds,
                    generated / seconds,
                    2 * matmul_params * useful / seconds,
                )
            row["speedup"] = ratio(result["hf"][0], result["fast"][0])  # per round: hf time / fast time
            row["mean_len"] = float(result["fast"][1].completion_mask.sum()) / (num_prompts * n)
            rows.append(row)
            print(f"  P={num_prompts} n={n}: speed-up {row['speedup'].text(unit='x')}", flush=True)
        if args.ablate:
            ablate(model, params, args.repeats, gen)
    print(
        f"\nfp32 GEMM peak (2048^3 matmul, best of the run): {peak / 1e9:.1f} GFLOP/s; %pk = useful FLOP/s share"
    )
    print(f"{'model':>6} {'P':>3} {'n':>3} {'mean len':>8} | {'hf roll/s':>9} {'hf tok/s':>9} {'hf %pk':>6} | "
          f"{'fast roll/s':>11} {'fast tok/s':>10} {'fast %pk':>8} | {'speed-up [min-max]':>20}")  # fmt: skip
    for row in rows:
        (h_r, h_t, h_f), (f_r, f_t, f_f) = row["hf"], row["fast"]
        print(f"{row['model']:>6} {row['P']:>3} {row['n']:>3} {row['mean_len']:>8.2f} | {h_r:>9.0f} {h_t:>9.0f} "
              f"{100 * h_f / peak:>5.1f}% | {f_r:>11.0f} {f_t:>10.0f} {100 * f_f / peak:>7.1f}% | "
              f"{row['speedup'].text(unit='x'):>20}")  # fmt: skip
    print(f"rates from the median of {args.repeats} interleaved rounds; speed-up = median [min-max] of the "
          f"per-round ratio hf time / fast time; load average after: {load_average()}")


VARIANTS = {
    "default (static cache, compaction, shared prefill)": {},
    "dynamic cache (torch.cat per step)": {"cache": "dynamic"},
    "compact only when 1/4 of the batch finished": {"compact_fraction": 0.25},
    "no compaction": {"compaction": False},
    "no shared prefill": {"shared_prefill": False},
    "model's top-level forward (no layer loop)": {"layer_loop": False},
}


def ablate(model: torch.nn.Module, params: SamplingParams, repeats: int, gen: torch.Generator) -> None:
    """Rollouts/s of FastEngine variants relative to the default, each shape timed side by side."""
    engines = {label: FastEngine(model, Tok(), **options) for label, options in VARIANTS.items()}
    for num_prompts, n in [(8, 64), (64, 64)]:
        prompts = [torch.randint(2, VOCAB, (10,), generator=gen).tolist() for _ in range(num_prompts)]
        result = run_shape(engines, prompts, n, repeats, params)
        base = result[next(iter(VARIANTS))][0]
        print(f"  ablation (P={num_prompts}, n={n}): " + ", ".join(
            f"{label}: {num_prompts * n / statistics.median(times):.0f} roll/s "
            f"({ratio(base, times).text(unit='x')})"
            for label, (times, _) in result.items()
        ))  # fmt: skip


if __name__ == "__main__":
    main()
