"""Every tokenizer podsrl builds or loads reloads as itself from the directories podsrl writes (a checkpoint's
model/, LoRA's merged/, a warm-up): the same ids for the tasks' own texts, spaces and newlines included, through
podsrl's loader and through transformers' AutoTokenizer (what `podsrl eval --model`, vLLM and users read)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Tokenizer

from podsrl.config import TinyModelConfig
from podsrl.models.loading import CHARS, EOS, PAD, UNK, build_char_tokenizer, build_tiny_model, load_tokenizer
from podsrl.tasks.arithmetic import ArithmeticTask
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask

# a dataset task's prompts and the docs' TRL example (docs/episodes.md): the texts that lost their spaces
SPACED = ["What is 12 plus 7?", "25+49= Use add.", "Answer:\n  two  spaces, a trailing one \n",
          '<tool_call>{"name": "add", "arguments": {"a": 25, "b": 49}}</tool_call>', "<eos> ends here <pad>"]


def task_texts() -> list[str]:
    """The built-in tasks' prompts and reference completions (the episode task's turns and tool answers)."""
    plain, tool = ArithmeticTask(seed=3, eval_size=4), ArithmeticToolTask(seed=3, eval_size=4, tool_share=1.0)
    texts = []
    for i in range(4):
        problem = plain.problem(i)
        texts += [problem.prompt, plain.reference_completion(problem)]
        texts += [part for turn in tool.reference_turns(tool.problem(i)) for part in turn]
    return texts + SPACED


def old_char_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in tokenizer as checkpoints written before it became a byte-level BPE hold it (WordLevel)."""
    vocab = {PAD: 0, EOS: 1, UNK: 2, **{c: 3 + i for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="left")


def pretrained_bpe() -> Qwen2Tokenizer:
    """A loaded model's kind of tokenizer: byte-level BPE with merges (a small Qwen2 one, written here)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = sorted(set(bytes_to_unicode().values()))
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", *alphabet, "Ġt", "he", "Ġthe", "12"])}
    return Qwen2Tokenizer(vocab=vocab, merges=[("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2")])


def saved(tokenizer, path, merged: bool = False):
    """The directory as podsrl writes it: the built-in model's weights and config (model_type qwen2), the tokenizer
    beside them (run/checkpoint.py's model/, lora.py's merged/ and run/warmup.py's cache all do this)."""
    from podsrl.lora import apply_lora, export_merged

    model = build_tiny_model(TinyModelConfig(num_layers=1, hidden_size=16, num_heads=2, intermediate_size=32),
                             build_char_tokenizer())
    if merged:
        export_merged(apply_lora(model, 2, 4, 0.0, ["q_proj"]), path, tokenizer)
    else:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def ids(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


@pytest.mark.parametrize("merged", [False, True], ids=["model", "merged"])
@pytest.mark.parametrize("make", [build_char_tokenizer, pretrained_bpe], ids=["built_in", "bpe"])
def test_tokenizers_reload_as_themselves(tmp_path, make, merged):
    tokenizer, texts = make(), task_texts()
    path = saved(tokenizer, tmp_path / "dir", merged)
    for reloaded in (load_tokenizer(path), AutoTokenizer.from_pretrained(path)):
        assert ids(reloaded, texts) == ids(tokenizer, texts)
        assert [reloaded.decode(i) for i in ids(reloaded, texts)] == [tokenizer.decode(i) for i in ids(tokenizer, texts)]
    assert load_tokenizer(path).padding_side == "left"


def test_built_in_tokenizer_is_one_token_a_character_with_the_old_ids():
    """Weights trained with the earlier WordLevel tokenizer read the same ids: the change is only in how it is saved."""
    new, old = build_char_tokenizer(), old_char_tokenizer()
    texts = task_texts() + ["".join(CHARS)]
    assert ids(new, texts) == ids(old, texts)
    assert all(len(i) == len(t) for i, t in zip(ids(new, texts), texts) if "<" not in t)  # specials: one token
    assert [new.decode(i) for i in ids(new, texts)] == texts
    assert (new.pad_token_id, new.eos_token_id, new.padding_side) == (0, 1, "left")


def test_checkpoint_written_with_the_old_tokenizer_loads_as_written(tmp_path):
    old = old_char_tokenizer()
    path = saved(old, tmp_path / "model")
    assert json.loads((tmp_path / "model" / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    texts = task_texts() + ["a\tb", "café"]  # characters outside the vocabulary: <unk>, as when it was written
    assert ids(load_tokenizer(path), texts) == ids(old, texts)
