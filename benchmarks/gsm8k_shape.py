"""The GSM8K-shaped benchmark workload, built offline: a random-init Qwen2 of ~13M parameters with a 32k vocabulary
(or another of `SHAPES`: Qwen2.5-0.5B's), prompts of ~200 tokens, a cheap continuous reward. update_speed.py uses the model on random token ids (the update
alone); step_throughput.py --workload gsm8k (the full step against TRL) saves it as a local model directory with a
byte-level BPE tokenizer trained here (what transformers loads for a Qwen2 directory: it reads a Qwen2 model's
tokenizer as Qwen2's byte-level BPE whatever tokenizer.json holds), a jsonl data file and a reward file, the way a
user brings their own.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 32000
SPECIALS = ("<|endoftext|>", "<|im_end|>")  # padding, end of completion
PROMPT_TOKENS = 200

REWARD_SOURCE = '''
def word_reward(prompts, completions, **columns):
    """Cheap and continuous: the share of vowels among the completion's letters."""
    return [sum(c in "aeiou" for c in text) / max(sum(c.isalpha() for c in text), 1) for text in completions]
'''


def token_prompts(count: int, generator: torch.Generator) -> list[list[int]]:
    """`count` prompts of PROMPT_TOKENS - 20 to + 15 random token ids, for the engine benchmarks without a tokenizer."""
    return [torch.randint(2, VOCAB, (PROMPT_TOKENS - 20 + 5 * i % 40,), generator=generator).tolist()
            for i in range(count)]


# write_workload's model shapes: (hidden, layers, heads, kv heads, intermediate, vocabulary or None for the
# tokenizer's); "0.5b" is Qwen2.5-0.5B's, whose 151,936 embedding rows are more than its tokenizer's 151,665 (and
# here than the 32k-token tokenizer's: ids past it decode to nothing, as a real model's padding rows would)
SHAPES = {
    "13m": (256, 6, 4, 2, 768, None),
    "0.5b": (896, 24, 14, 2, 4864, 151936),
    "tiny": (64, 2, 4, 2, 192, None),  # the plumbing on a CPU
}


def gsm8k_model(seed: int = 0, hidden: int = 256, layers: int = 6, heads: int = 4, vocab: int = VOCAB,
                eos: int = 1, pad: int = 0, positions: int = 1024, kv_heads: int | None = None,
                intermediate: int | None = None):
    """Random-init Qwen2 with a 32k vocabulary (tied embeddings): ~13M parameters at the default width; by default
    half as many key/value heads as heads and an MLP 3x the width."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads // 2, max_position_embeddings=positions,
        tie_word_embeddings=True, pad_token_id=pad, eos_token_id=eos, bos_token_id=None))


def bpe_tokenizer(seed: int = 0, vocab: int = VOCAB, words: int = 200_000):
    """A byte-level BPE tokenizer with a `vocab`-token vocabulary, trained on `words` random lowercase words
    (seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    gen = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(letters[int(i)] for i in torch.randint(0, 26, (int(n),), generator=gen))
             for n in torch.randint(2, 9, (words,), generator=gen)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(words[i:i + 50]) for i in range(0, len(words), 50)],
                            trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS),
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   padding_side="left")


def random_prompts(tokenizer, count: int, seed: int = 0) -> list[str]:
    """Texts of ~PROMPT_TOKENS tokens: random non-special ids, decoded."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIALS), len(tokenizer), (count, PROMPT_TOKENS), generator=gen)
    return [tokenizer.decode(row.tolist()) for row in ids]


def write_workload(folder: Path, prompts: int = 64, seed: int = 0, shape: str = "13m") -> dict[str, Path]:
    """The model directory (a model of `SHAPES[shape]`), a jsonl of prompts (with a placeholder answer) and the reward
    file under `folder`. The tiny shape's tokenizer is small too (1,000 tokens, seconds to train on a busy CPU)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"model": folder / "model", "data": folder / "train.jsonl", "reward": folder / "reward.py"}
    hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[shape]
    tokenizer = bpe_tokenizer(seed, **({"vocab": 1000, "words": 5000} if shape == "tiny" else {}))
    model = gsm8k_model(seed, hidden, layers, heads, vocab=vocab or len(tokenizer), eos=tokenizer.eos_token_id,
                        pad=tokenizer.pad_token_id, kv_heads=kv_heads, intermediate=intermediate)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    paths["data"].write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n"
                                     for p in random_prompts(tokenizer, prompts, seed)))
    paths["reward"].write_text(REWARD_SOURCE)
    return paths
