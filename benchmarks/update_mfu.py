"""The update's model FLOP utilisation at Qwen2.5-0.5B's shape (random weights; bfloat16 autocast over float32
masters, what `model.compute_dtype: auto` is on CUDA): 4 prompts of 200 tokens x 16 rollouts = 64 rows, every
completion `L` tokens long, for each `--lengths` L (default 256 and 1,024), through podsrl's PolicyUpdater (GRPO
loss, the shared-prompt path, fused AdamW as the trainer builds it), micro-batches as large as `podsrl plan --memory`
says fit the device (CUDA; `--micro-batch` on the CPU). The lengths alternate round by round; `--repeats` timed
updates each after one untimed, median wall and GPU-event seconds.

    MFU = 6 x matmul parameters x tokens / seconds / peak
  - parameters: all of the model's, the tied embedding counted once as the output layer (494M at this shape); the
    output layer's 6 x vocab x width goes with the completion tokens only (no logits are taken at prompt tokens),
    the rest with every token forwarded: each group's prompt once (the shared-prompt path) and every completion token;
  - attention's own FLOPs (QK^T and PV, causal, forward and backward: 3 x 4 x heads x head_dim per query and key
    position attended) are not counted in MFU; their count is printed beside it as a share of the 6NT figure;
  - peak: the H200's dense bfloat16 989 TFLOP/s by its datasheet (the target's); the share of a square bf16
    matmul's rate measured in the same run is printed beside it.
The target: >= 30% MFU with 1,024-token completions. Results go to `--json` as they come.

    python benchmarks/update_mfu.py --device cuda --json /tmp/mfu.json
    python benchmarks/update_mfu.py --device cpu --model tiny --lengths 8 16 --micro-batch 16 --repeats 1 --compute float32
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_generation import MODELS, build_model  # noqa: E402
from benchmarks.speed_results import H200_BF16_FLOPS, DeviceTimer, add_ceiling_arguments, start_part  # noqa: E402
from benchmarks.update_speed import make_batch  # noqa: E402

PROMPTS, N, PROMPT_TOKENS = 4, 16, 200


def planned_micro_batch(model, length: int, compute: str) -> int:
    """The largest micro-batch `podsrl plan --memory` says fits this device's memory (0: none)."""
    from podsrl.planning.memory import make_plan
    from podsrl.planning.workload import Workload, model_shape

    work = Workload(PROMPTS, N, N, PROMPT_TOKENS, length, compute_dtype=compute, device="cuda")
    return make_plan(model_shape(model.config), work, torch.cuda.get_device_properties(0).total_memory).micro_batch[False]


def flops(model, length: int) -> dict:
    """The update's matmul FLOPs (6NT as the module docstring counts them) and attention's, for one update."""
    c = model.config
    head = c.vocab_size * c.hidden_size
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    completion = PROMPTS * N * length
    tokens = PROMPTS * PROMPT_TOKENS + completion
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # keys attended: each group's prompt causally once; each completion token the prompt and its own earlier tokens
    attended = PROMPTS * (PROMPT_TOKENS * (PROMPT_TOKENS + 1) // 2
                          + N * (length * PROMPT_TOKENS + length * (length + 1) // 2))
    return {"matmul": 6 * (body * tokens + head * completion), "tokens": tokens, "completion_tokens": completion,
            "attention": 3 * 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * attended,
            "params": body + head}


def make_updaters(model, lengths: list[int], opts) -> dict:
    from podsrl.config import load_config
    from podsrl.config.facts import run_facts
    from podsrl.update import PolicyUpdater, UpdateSettings
    from podsrl.update.optimizer import build_optimizer

    updaters, optimizer = {}, None
    for length in lengths:
        micro = opts.micro_batch or planned_micro_batch(model, length, opts.compute)
        cfg = load_config(None, [f"model.device={opts.device}", f"model.compute_dtype={opts.compute}",
                                 f"rollout.n={N}", "method=grpo", f"rollout.max_new_tokens={length}",
                                 f"optim.micro_batch_size={max(micro, 1)}", "algo.rollout_correction=none"])
        if optimizer is None:  # one model, one optimiser: the lengths train the same weights in turn
            optimizer, scheduler = build_optimizer(cfg, model, sharded=False)
        updaters[length] = PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg),
                                         run_facts(cfg, torch.device(opts.device)))
    return updaters


def batches(vocab: int, lengths: list[int]) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(PROMPTS)]
    return {length: make_batch(prompts, N, [torch.randint(2, vocab, (length,), generator=gen).tolist()
                                            for _ in range(PROMPTS * N)], 0, gen) for length in lengths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=list(MODELS), default="0.5b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--compute", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--micro-batch", type=int, default=0, help="rows per micro-batch (0: the memory plan's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per length after one untimed")
    add_ceiling_arguments(parser)
    opts = parser.parse_args()
    cuda = opts.device.startswith("cuda")
    results, ceilings = start_part(opts, "update MFU")
    model, total, _ = build_model(opts.model, opts.device, torch.float32, eos_bias=None,
                                  positions=PROMPT_TOKENS + max(opts.lengths))
    model.train()
    updaters, data = make_updaters(model, opts.lengths, opts), batches(model.config.vocab_size, opts.lengths)
    times: dict[int, list[DeviceTimer]] = {length: [] for length in opts.lengths}
    for r in range(opts.repeats + 1):
        for length in opts.lengths if r % 2 == 0 else opts.lengths[::-1]:
            with DeviceTimer(opts.device) as timer:
                updaters[length].update(data[length], torch.Generator().manual_seed(r))
                updaters[length].optimizer.zero_grad(set_to_none=True)
            if r:
                times[length].append(timer)
    print(f"{opts.model}: {total / 1e6:.1f}M parameters, {PROMPTS} prompts of {PROMPT_TOKENS} tokens x {N} rows, "
          f"compute {opts.compute}; bf16 matmul measured {ceilings['matmul_flops'] / 1e12:.0f} TFLOP/s, peak used "
          f"{H200_BF16_FLOPS / 1e12:.0f} TFLOP/s", flush=True)
    rows, lines = {}, []
    for length in opts.lengths:
        f = flops(model, length)
        wall = statistics.median(t.wall for t in times[length])
        gpu = statistics.median(t.gpu for t in times[length]) if cuda else None
        mfu = f["matmul"] / wall / H200_BF16_FLOPS
        rows[length] = {**f, "micro_batch": updaters[length].cfg.optim.micro_batch_size,
                        "wall_s": [t.wall for t in times[length]], "gpu_s": [t.gpu for t in times[length]],
                        "median_wall_s": wall, "median_gpu_s": gpu, "mfu": mfu,
                        "of_measured_matmul": f["matmul"] / wall / ceilings["matmul_flops"],
                        "attention_share_of_6nt": f["attention"] / f["matmul"]}
        results.put("lengths", rows)
        lines.append(f"{length} tokens: {wall * 1e3:.0f} ms, MFU {100 * mfu:.1f}%")
        print(f"  completions of {length}: micro-batch {rows[length]['micro_batch']}, update {wall * 1e3:.1f} ms"
              f"{'' if gpu is None else f' (GPU events {gpu * 1e3:.1f} ms)'}, {f['matmul'] / 1e12:.1f} TFLOP (6NT) "
              f"-> MFU {100 * mfu:.1f}% of {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s, "
              f"{100 * rows[length]['of_measured_matmul']:.1f}% of the measured matmul rate; attention "
              f"(not counted) {100 * rows[length]['attention_share_of_6nt']:.1f}% of the 6NT FLOPs", flush=True)
        results.summary(f"update MFU at {opts.model}, 64 rows (6NT over {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s, "
                        f"attention not counted): " + "; ".join(lines))
    results.target("update MFU, 0.5B, 1,024-token completions",
                   rows[1024]["mfu"] if 1024 in rows and opts.model == "0.5b" else None)


if __name__ == "__main__":
    main()
