"""Rollout generation: podsrl's fast engine vs vLLM (the vllm engine over vLLM's CPU build), side by side in one run.

Both engines sample the same request: the same float32 model, prompts, rows, completion length and sampling
(temperature 1, log-probs returned, one seed per row), as a training step asks. Rows run to max_new_tokens: the
engines' EOS option is an id the built-in model does not sample and the random one samples with probability 1/V a
token (a row may end early: each arm's tokens/s counts its own tokens, within 1% of each other). Arms
interleave (benchmarks/timing.py), `--repeats` (>= 5) rounds after an untimed warm-up call each; tokens/s from the
median round, the ratio (vLLM's time over the fast engine's) as the median and range of the per-round ratios.
vLLM runs as the vllm engine starts it, compiled (vLLM's default on the CPU: torch.compile with inductor at
start-up, whose time is printed apart and not counted); `--eager` starts it with enforce_eager instead.

Models: `builtin`, the built-in model at the shipped warm-up (0.8M parameters, vocabulary 128), prompts from the
built-in task; `qwen2_18m`, a Qwen2-shaped model built from its config (18.6M parameters, vocabulary 32,000: the
embedding is two thirds of it), random prompts. Where each spends its time: one more call of each arm under
cProfile, its top functions by own time written to the output folder (`profile_<model>_<rows>_<arm>.txt`).

    python benchmarks/generation_vs_vllm.py --out docs/results/generation_vs_vllm_2026-12-07
    python benchmarks/generation_vs_vllm.py --models builtin --rows 16 --repeats 5

Needs vLLM's CPU build (README.md, "vLLM on the CPU").
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from benchmarks.timing import MIN_REPEATS, Spread, interleaved, machine_line, ratio
from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.engines.vllm import VLLMEngine
from podsrl.run.warmup import SHIPPED
from podsrl.tasks.arithmetic import ArithmeticTask

NEVER = 2  # the EOS option of both engines: <unk> in the built-in vocabulary, any id of the random model
# name: (prompt tokens, completion tokens); the built-in model's context is 64 positions
LENGTHS = {"builtin": (8, 48), "qwen2_18m": (64, 64)}


def builtin_model():
    path = next(p for p in sorted(SHIPPED.iterdir()) if (p / "config.json").is_file())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    problems = ArithmeticTask(seed=0).eval_set()
    prompts = [tokenizer(p.prompt, add_special_tokens=False).input_ids for p in problems]
    return model, [p for p in prompts if len(p) == LENGTHS["builtin"][0]]


def qwen2_18m():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (LENGTHS["qwen2_18m"][0],), generator=g).tolist() for _ in range(256)]
    return model, prompts


MODELS = {"builtin": builtin_model, "qwen2_18m": qwen2_18m}


def profile_text(call, top: int = 25) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    out.write("\n--- by cumulative time ---\n")
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def arm(engine, key: str, request, params: SamplingParams, tokens: dict[str, int]):
    """One timed call of `engine` on the request; the tokens it generated land in tokens[key]."""
    def call():
        result = engine.generate(request[0], request[1], params, request[2])
        tokens[key] = int(result.completion_mask.sum())
    return call


def measure(name: str, rows_list: list[int], repeats: int, eager: bool, out: Path | None) -> list[dict]:
    model, prompts = MODELS[name]()
    params_count = sum(p.numel() for p in model.parameters())
    prompt_len, new_tokens = LENGTHS[name]
    options = {"eos_token_id": NEVER, "pad_token_id": 0}
    fast = FastEngine(model, None, **options)
    start = time.perf_counter()
    vllm = VLLMEngine(model, None, kv_cache_gib=1.0, enforce_eager=eager, **options)
    vllm_start = time.perf_counter() - start
    print(f"{name}: {params_count / 1e6:.1f}M parameters, prompt {prompt_len}, completion {new_tokens} tokens; "
          f"vLLM start-up {vllm_start:.1f} s ({'eager' if eager else 'compiled'})", flush=True)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    records = []
    for rows in rows_list:
        # one row per prompt, up to 16 prompts, the rest as more rows of them (a group of rollouts, as in training)
        distinct = min(16, rows)
        request = ([p for p in prompts[:distinct]], [rows // distinct] * distinct, torch.arange(rows) * 7919 + 1)
        tokens: dict[str, int] = {}
        arms = {"fast": arm(fast, "fast", request, params, tokens), "vllm": arm(vllm, "vllm", request, params, tokens)}
        times = interleaved(arms, repeats=repeats)
        # the random model samples the EOS option's id with probability ~1/V a token: a row may end early
        assert min(tokens.values()) >= 0.99 * rows * new_tokens, tokens
        spreads = {k: Spread.of(v) for k, v in times.items()}
        speed = ratio(times["vllm"], times["fast"])
        record = {"model": name, "params_m": round(params_count / 1e6, 2), "rows": rows, "prompt": prompt_len,
                  "completion": new_tokens, "tokens": tokens["fast"], "vllm_compiled": not eager,
                  "vllm_startup_s": round(vllm_start, 2), "seconds": times,
                  "tokens_per_s": {k: tokens[k] / s.median for k, s in spreads.items()},
                  "vllm_over_fast_time": {"median": speed.median, "low": speed.low, "high": speed.high},
                  "machine": machine_line()}
        records.append(record)
        print(f"  rows {rows:4d}: fast {record['tokens_per_s']['fast']:8.0f} tok/s {spreads['fast'].text(unit=' s')}"
              f" | vllm {record['tokens_per_s']['vllm']:8.0f} tok/s {spreads['vllm'].text(unit=' s')}"
              f" | vllm time / fast time {speed.text(unit='x')}", flush=True)
        if out is not None:
            for key, call in arms.items():
                (out / f"profile_{name}_{rows}_{key}.txt").write_text(profile_text(call))
    vllm.close()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 256])
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    parser.add_argument("--eager", action="store_true", help="start vLLM with enforce_eager (no compile)")
    parser.add_argument("--out", type=Path, help="folder for results.jsonl and the profiles")
    args = parser.parse_args()
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats: at least {MIN_REPEATS}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    print(machine_line(), flush=True)
    records = [r for name in args.models for r in measure(name, args.rows, args.repeats, args.eager, args.out)]
    print(machine_line(), flush=True)
    if args.out is not None:
        with open(args.out / "results.jsonl", "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
