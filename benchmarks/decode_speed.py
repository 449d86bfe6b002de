"""Decode at Qwen2.5-0.5B's shape with rows finishing, against its rooflines; and what a training step captures.

Part 1, the engine. The fast engine as the trainer builds it (CUDA graphs on CUDA) over a random-init model of
Qwen2.5-0.5B's shape in bfloat16 (`--dtype`), `--prompts` prompts of `--prompt-len` tokens x n = 16 (128 rows) and x 64 (512
rows), temperature 1, at most `--max-new-tokens`. EOS is on: its logit gets a bias calibrated on the model's own
logits so that a row stops with probability 1 / `--mean-length` a token; rows finish along the call (some reach the
cap) and the engine's rows shrink with them. Per shape one first call (it captures the graphs), then `--repeats`
interleaved timed calls with the same seeds (the same rollouts each call). Rooflines of a call, from its rows' actual
lengths (a decode step t reads every weight once and, for each row still generating, the keys and values of its
prompt + t positions; it computes 2 x matmul parameters per row still generating plus attention's 4 x layers x heads
x head_dim per position read; the prefill of each distinct prompt is added to both):
  bandwidth floor = bytes / 4.8 TB/s, compute floor = FLOPs / 989 TFLOP/s (the H200's datasheet figures, the
  targets'); % of a roofline = its floor / the call's measured time. The copy and matmul rates measured in the same
  run are printed beside them.
Targets: >= 25% of the bandwidth roofline at 128 rows, >= 30% of the compute roofline at 512.

Part 2, the trainer. `--train-steps` steps of podsrl's Trainer (the built-in task, untrained: warmup.steps=0, so rows
end at a random EOS during each step's generation) on the built-in model at Qwen2.5-0.5B's layer shape (24 layers,
width 896, MLP 4,864, 14 heads; 7 KV heads and a ~20-token vocabulary where Qwen2.5 has 2 and 151,936),
`--train-prompts` (8) x 16 = 128 rows: per step the CUDA-graph captures it made and their seconds (benchmarks/speed_results.py
CaptureCounter), beside time/generate and time/update. That is the re-capture cost a training step pays, whatever the
engine and trainer keep across the update.

    python benchmarks/decode_speed.py --device cuda --json /tmp/decode.json
    python benchmarks/decode_speed.py --device cpu --dtype float32 --model tiny --max-new-tokens 16 --mean-length 8 \\
        --repeats 1 --train-steps 2 --train-shape tiny --train-prompts 2        # plumbing
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_generation import EOS, MODELS, Tok, build_model  # noqa: E402
from benchmarks.speed_results import (  # noqa: E402
    H200_BANDWIDTH,
    H200_BF16_FLOPS,
    CaptureCounter,
    DeviceTimer,
    Results,
    add_ceiling_arguments,
    start_part,
)

TRAIN_SHAPES = {  # the built-in model's layers for part 2: 0.5B's, or a tiny one for the CPU
    "0.5b": ["model.tiny.hidden_size=896", "model.tiny.num_layers=24", "model.tiny.num_heads=14",
             "model.tiny.intermediate_size=4864", "model.tiny.max_position_embeddings=320"],
    "tiny": ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
             "model.tiny.intermediate_size=64", "model.tiny.max_position_embeddings=64"],
}


def eos_bias(model, prompts: list[list[int]], mean_length: float, device: str) -> float:
    """The EOS bias that makes p(EOS) = 1 / mean_length at the prompts' last positions (median over prompts)."""
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        logits = model(ids).logits[:, -1].float() - model.lm_head.bias.float()  # the built-in bias is replaced
    others = torch.cat([logits[:, :EOS], logits[:, EOS + 1:]], dim=1).logsumexp(-1)
    p = 1 / mean_length
    return float(math.log(p / (1 - p)) + (others - logits[:, EOS]).median())


def floors(model, prompt_len: int, distinct: int, lengths: list[int], matmul_params: int) -> dict:
    """Bytes and FLOPs a call needs at least (the module docstring), and the floors at the H200's ceilings."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    element = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * element
    attention_per_position = 4 * c.num_hidden_layers * c.num_attention_heads * head_dim
    nbytes = weights + per_position * distinct * prompt_len  # the prefill: weights once, the prompts' cache written
    flops = 2 * matmul_params * distinct * prompt_len + attention_per_position * distinct * prompt_len**2 / 2
    for t in range(1, max(lengths)):
        live = sum(1 for n in lengths if n > t)  # rows whose token t + 1 this step makes
        nbytes += weights + per_position * live * (prompt_len + t)
        flops += 2 * matmul_params * live + attention_per_position * live * (prompt_len + t)
    return {"bytes": nbytes, "flops": flops, "bandwidth_floor_s": nbytes / H200_BANDWIDTH,
            "compute_floor_s": flops / H200_BF16_FLOPS}


def engine_part(opts, results: Results, ceilings: dict) -> dict:
    from podsrl.engines.base import SamplingParams
    from podsrl.engines.fast import FastEngine

    dtype = getattr(torch, opts.dtype)
    positions = opts.prompt_len + opts.max_new_tokens
    model, total, matmul = build_model(opts.model, opts.device, dtype, eos_bias=0.0, positions=positions)
    vocab = MODELS[opts.model][5]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, vocab, (opts.prompt_len,), generator=gen).tolist() for _ in range(opts.prompts)]
    bias = eos_bias(model, prompts, opts.mean_length, opts.device)
    with torch.no_grad():
        model.lm_head.bias[EOS] = bias
    engine = FastEngine(model, Tok())
    params = SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=1.0)

    def call(n: int):  # fixed per-row seeds: every call generates the same rollouts
        return engine.generate(prompts, [n] * opts.prompts, params, torch.arange(opts.prompts * n))

    shapes = {}
    for n in opts.n:
        with CaptureCounter() as captures, DeviceTimer(opts.device) as first:
            lengths = call(n).completion_mask.sum(1).long().tolist()
        shapes[n] = {"rows": opts.prompts * n, "lengths": lengths, "first_s": first.wall,
                     "first_captures": captures.count, "wall_s": []}
    for r in range(opts.repeats):
        for n in opts.n if r % 2 == 0 else opts.n[::-1]:
            with DeviceTimer(opts.device) as timer:
                call(n)
            shapes[n]["wall_s"].append(timer.wall)
    out = {}
    for n, s in shapes.items():
        f = floors(model, opts.prompt_len, opts.prompts, s["lengths"], matmul)
        seconds, tokens = statistics.median(s["wall_s"]), sum(s["lengths"])
        out[s["rows"]] = {
            "rows": s["rows"], "n": n, "wall_s": s["wall_s"], "median_s": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "mean_length": tokens / s["rows"],
            "rows_at_cap": sum(1 for x in s["lengths"] if x >= opts.max_new_tokens),
            "first_call_s": s["first_s"], "first_call_captures": s["first_captures"], **f,
            "bandwidth_share": f["bandwidth_floor_s"] / seconds, "compute_share": f["compute_floor_s"] / seconds,
            "measured_bandwidth_share": f["bytes"] / ceilings["copy_bytes_per_s"] / seconds,
            "measured_compute_share": f["flops"] / ceilings["matmul_flops"] / seconds}
        o = out[s["rows"]]
        print(f"  {s['rows']:>4} rows: {seconds * 1e3:.0f} ms a call, {o['tokens_per_s']:,.0f} tokens/s, mean length "
              f"{o['mean_length']:.0f} ({o['rows_at_cap']} rows at the cap); bandwidth roofline "
              f"{100 * o['bandwidth_share']:.1f}% (floor {f['bandwidth_floor_s'] * 1e3:.1f} ms), compute roofline "
              f"{100 * o['compute_share']:.1f}% (floor {f['compute_floor_s'] * 1e3:.1f} ms); first call "
              f"{s['first_s']:.2f} s with {s['first_captures']} captures", flush=True)
        results.put("engine", {"model": opts.model, "parameters": total, "eos_bias": bias,
                               "prompt_len": opts.prompt_len, "prompts": opts.prompts,
                               "max_new_tokens": opts.max_new_tokens, "mean_length_asked": opts.mean_length,
                               "shapes": out})
    engine.close()
    return out


def trainer_part(opts, results: Results) -> dict:
    """Training steps through podsrl's Trainer: the captures each step makes, and their seconds."""
    from podsrl.config import load_config
    from podsrl.run.trainer import Trainer

    overrides = [f"output_dir={tempfile.mkdtemp(prefix='decode_speed_')}", f"model.device={opts.device}",
                 "warmup.steps=0", f"rollout.prompts_per_step={opts.train_prompts}", "rollout.n=16", "method=grpo",
                 f"rollout.max_new_tokens={opts.max_new_tokens}", "task.eval_size=8", "log.progress=false",
                 "log.tensorboard=false", "log.plot=false", *TRAIN_SHAPES[opts.train_shape]]
    trainer = Trainer(load_config(None, overrides))
    steps = []
    with CaptureCounter() as captures:
        for i in range(opts.train_steps):
            before = captures.count
            m = trainer.train_step().metrics
            count, seconds = captures.since(before)
            steps.append({"captures": count, "capture_s": seconds, "time/generate": m["time/generate"],
                          "time/update": m["time/update"], "time/step": m["time/step"],
                          "tokens/generated": m["tokens/generated"]})
            print(f"  step {i + 1}: {count} captures, {seconds * 1e3:.0f} ms in them; generate "
                  f"{m['time/generate'] * 1e3:.0f} ms, update {m['time/update'] * 1e3:.0f} ms", flush=True)
            results.put("training_steps", {"shape": opts.train_shape, "rows": 16 * opts.train_prompts, "steps": steps})
    trainer.logger.close()
    trainer.parts.engine.close()
    return {"steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=list(MODELS), default="0.5b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--mean-length", type=float, default=128, help="the mean length EOS is calibrated to")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per shape, interleaved")
    parser.add_argument("--train-steps", type=int, default=4)
    parser.add_argument("--train-shape", choices=list(TRAIN_SHAPES), default="0.5b")
    parser.add_argument("--train-prompts", type=int, default=8, help="prompts a training step (x 16 rollouts)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the engine part's")
    add_ceiling_arguments(parser)
    opts = parser.parse_args()
    results, ceilings = start_part(opts, "decode")
    print(f"== the engine, {opts.model}, {opts.dtype}, EOS on (mean length {opts.mean_length:g} asked, cap "
          f"{opts.max_new_tokens}); measured copy {ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
          f"{ceilings['matmul_flops'] / 1e12:.0f} TFLOP/s; floors at 4.8 TB/s and 989 TFLOP/s", flush=True)
    shapes = engine_part(opts, results, ceilings)
    if opts.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the engine part's model and cache are gone
    line = "; ".join(f"{rows} rows {s['tokens_per_s']:,.0f} tok/s, {100 * s['bandwidth_share']:.1f}% of bandwidth / "
                     f"{100 * s['compute_share']:.1f}% of compute roofline" for rows, s in shapes.items())
    results.summary(f"decode at {opts.model}, EOS on: {line}")
    results.target("decode, 128 rows, share of the bandwidth roofline",
                   shapes[128]["bandwidth_share"] if 128 in shapes and opts.model == "0.5b" else None)
    results.target("decode, 512 rows, share of the compute roofline",
                   shapes[512]["compute_share"] if 512 in shapes and opts.model == "0.5b" else None)
    print(f"== training steps (the built-in model at {opts.train_shape}'s layers, {16 * opts.train_prompts} rows): "
          "captures per step",
          flush=True)
    steps = trainer_part(opts, results)["steps"]
    later = steps[1:] or steps
    line += (f"; training: {steps[0]['captures']} captures in step 1 ({steps[0]['capture_s'] * 1e3:.0f} ms), then "
             f"{statistics.median(s['captures'] for s in later):.0f} a step "
             f"({statistics.median(s['capture_s'] for s in later) * 1e3:.0f} ms of "
             f"{statistics.median(s['time/generate'] for s in later) * 1e3:.0f} ms generating)")
    results.summary(f"decode at {opts.model}, EOS on: {line}")


if __name__ == "__main__":
    main()
