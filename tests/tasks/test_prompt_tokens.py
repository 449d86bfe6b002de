"""A tokenizer that encodes a prompt to nothing stops the run at start-up with one line naming the row: transformers
5 loads any tokenizer in a Qwen2 model directory as Qwen2's byte-level BPE, which reads a word-level tokenizer.json
as an empty vocabulary, and generation then crashed deep inside `generate`."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from podsrl.batch import Problem
from podsrl.errors import DataError
from podsrl.tasks.prompt_length import PromptLimit


def test_a_prompt_that_encodes_to_no_tokens_names_its_row(tmp_path):
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "seven": 3, "apples": 4}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    Qwen2Config(vocab_size=5, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    problems = [Problem("a", "seven apples", "7")]
    if tokenizer("seven apples", add_special_tokens=False).input_ids:  # a release that reads it right: nothing to say
        assert PromptLimit(tokenizer, 100).apply(problems, ["train.jsonl: line 1"])[0] == problems
        return
    with pytest.raises(DataError, match=r"^train.jsonl: line 1: the prompt encodes to no tokens"):
        PromptLimit(tokenizer, 100).apply(problems, ["train.jsonl: line 1"])


def test_an_empty_prompt_is_not_this_error():
    class Characters:
        def __call__(self, texts, add_special_tokens=False):
            return type("Encoded", (), {"input_ids": [list(t) for t in texts]})()

    kept = PromptLimit(Characters(), 10).apply([Problem("a", "", "7"), Problem("b", "12", "3")], ["r1", "r2"])[0]
    assert [p.uid for p in kept] == ["a", "b"]
