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


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_model(im_end_bias: float = 2.5, seed: int = 0):
    """(model, tokenizer): a tiny Qwen2 and a tokenizer built offline whose chat turns end with <|im_end|>, which is
    not the tokenizer's EOS; the model's generation config lists both, as Qwen2.5-Instruct's does. An output bias
    on <|im_end|> makes sampled rows end there at varied positions."""
    from podsrl.models.loading import TINY_VOCAB_SIZE, build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny_causal_lm(TINY_VOCAB_SIZE, seed=seed)
    with torch.no_grad():
        bias = torch.zeros(TINY_VOCAB_SIZE)
        bias[im_end] = im_end_bias
        model.lm_head.bias = torch.nn.Parameter(bias)
    model.generation_config.eos_token_id = [im_end, tokenizer.eos_token_id]
    return model, tokenizer


def chat_request(tokenizer, rows_per_prompt: int = 16):
    """(prompts, counts, seeds): two chat prompts ready for the assistant's turn."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               ["input_ids"] for text in ("1+1=", "What is 7*6?")]
    return prompts, [rows_per_prompt] * 2, torch.arange(2 * rows_per_prompt) * 7919 + 3


def assert_rows_end_at_their_first_stop(out, stops: set[int], max_new_tokens: int) -> dict[int, int]:
    """Each row's completion (its mask) ends at its first stop id, or runs to max_new_tokens without one (then it
    is truncated). Returns how many rows ended at each stop id."""
    ended: dict[int, int] = {}
    for tokens, mask, truncated in zip(out.completion_ids.tolist(), out.completion_mask, out.truncated):
        kept = tokens[: int(mask.sum())]
        assert not stops & set(kept[:-1]), f"a row went on past a stop token: {kept}"
        if bool(truncated):
            assert len(kept) == max_new_tokens and kept[-1] not in stops
        else:
            assert kept[-1] in stops, f"a row not truncated ends without a stop token: {kept}"
            ended[kept[-1]] = ended.get(kept[-1], 0) + 1
    return ended
