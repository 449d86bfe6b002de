"""The fast engine's decode step counted on the CPU as a GPU would run it: kernel launches per layer per step.

The model is Qwen2.5-0.5B's layout (GQA 14/2 heads, q/k/v bias, tied embeddings, SwiGLU) at a small width; the
step is the one CUDA graphs capture (engines/decode_step.py `decode_step` at a bucket: 64 rows, the cache read to a
multiple of 64 columns), run eagerly here and counted by benchmarks/device_ops.py (the model's parameters and
buffers, the step state, the KV cache, the fused weights and the rotary table as device tensors), with the attention
CUDA runs (`DecodeStack.fused_attention`: one scaled_dot_product_attention a layer, the rotation and residual adds
rounded once, where a CPU engine keeps grouped matmuls and transformers' bits; that path's count is printed too). A layer's share is the difference between stacks of 4 and 2
layers, halved; the rest (embedding, final norm, head, sampling, the mask, the rotary tables) is per step.

    python benchmarks/decode_ops.py

ends with `decode ops per layer per step: X`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.device_ops import DeviceOps  # noqa: E402
from podsrl.engines import SamplingParams  # noqa: E402
from podsrl.engines.decode_step import Buckets, Sampler, StepRunner  # noqa: E402
from podsrl.engines.fast import FastEngine  # noqa: E402

ROWS, PROMPT, NEW, VOCAB = 64, 20, 30, 2048


def model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=56, intermediate_size=304, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    return Qwen2ForCausalLM(config).eval()


def device_tensors(engine: FastEngine) -> list[torch.Tensor]:
    """What lives on the GPU while decoding: parameters, buffers, the state and its cache, the stack's tables."""
    state, stack = engine.state, engine.forward
    tensors = [*engine.model.parameters(), *engine.model.buffers(), stack.rotary]
    tensors += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
    tensors += state.cache.buffers
    for plan in stack.plans:
        tensors += [t for t in (*(plan.qkv or ()), plan.gate_up) if isinstance(t, torch.Tensor)]
    return tensors


def step_launches(layers: int, fused: bool = True) -> tuple[int, dict[str, int]]:
    """Launches of one bucketed decode step (sampled, no top-k/top-p) over a warm engine of `layers` layers, with
    CUDA's attention (`fused`) or the CPU's."""
    engine = FastEngine(model(layers), compaction=False)
    engine.forward.fused_attention = fused
    engine.runner, engine.buckets = StepRunner(), Buckets(block=64)
    prompts = [list(range(2 + i, 2 + i + PROMPT)) for i in range(ROWS)]
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0)
    engine.generate(prompts, [1] * ROWS, params, torch.arange(ROWS))  # binds the stack, keeps the state
    sampler = Sampler(greedy=False, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=engine.pad_token_id)
    with torch.inference_mode(), DeviceOps(device_tensors(engine)) as ops:
        engine.runner(engine.forward, engine.state, ROWS, 64, sampler)
    return ops.totals()["launches"], {name: n for (_, name), n in ops.launch_names.items()}


def main() -> None:
    cpu_four, _ = step_launches(4, fused=False)
    cpu_two, _ = step_launches(2, fused=False)
    print(f"with the CPU's attention (grouped matmuls): {(cpu_four - cpu_two) / 2:g} ops per layer per step")
    four, by_op = step_launches(4)
    two, _ = step_launches(2)
    per_layer = (four - two) / 2
    print(f"a decode step of {ROWS} rows, Qwen2.5-0.5B's layout at width 56: {two} launches with 2 layers, {four} "
          f"with 4; outside the layers {two - 2 * per_layer:.0f}")
    print("launches by operation (4 layers):", ", ".join(f"{k} {v}" for k, v in sorted(by_op.items(),
                                                                                    key=lambda kv: -kv[1])))
    print(f"decode ops per layer per step: {per_layer:g}")


if __name__ == "__main__":
    main()
