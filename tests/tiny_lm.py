"""Tiny random causal LMs and a tokenizer stub, shared by the engine, Ray and data-parallel tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

EOS, PAD = 1, 0


class TokStub:
    """All an engine needs of a tokenizer."""

    eos_token_id = EOS
    pad_token_id = PAD


def tiny_causal_lm(vocab: int, *, kind: str = "qwen", hidden: int = 64, intermediate: int = 128,
                   max_positions: int = 128, peak: float = 1.0, eos_bias: float | None = None,
                   attn: str | None = None, seed: int = 0):
    """A 2-layer Qwen2 (or 4-layer Llama) with random weights, in eval mode.

    `peak` scales the output head (non-trivial, tie-free greedy paths and varied samples); `eos_bias`, when given,
    adds an output bias on EOS (shorter, varied completion lengths); `attn` picks the attention implementation.
    """
    torch.manual_seed(seed)
    common = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": max_positions, "eos_token_id": EOS, "pad_token_id": PAD,
    }  # fmt: skip
    if attn is not None:
        common["attn_implementation"] = attn
    if kind == "qwen":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **common))
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
        if eos_bias is not None:
            bias = torch.zeros(vocab)
            bias[EOS] = eos_bias
            model.lm_head.bias = torch.nn.Parameter(bias)
    return model.eval()
