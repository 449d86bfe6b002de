"""A tokenizer that encodes a prompt to nothing stops the run at start-up with one line naming the row (transformers
5, for one, loads a word-level tokenizer.json in a Qwen2 model directory as an empty byte-level vocabulary, and
generation then crashed deep inside `generate`). The tokenizer here drops every letter, so it encodes "seven apples"
to no tokens on any release."""

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from podsrl.batch import Problem
from podsrl.errors import DataError
from podsrl.tasks.prompt_length import PromptLimit


def _digits_only_tokenizer() -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<eos>": 1, "<unk>": 2, "7": 3}, unk_token="<unk>"))
    words.normalizer = normalizers.Replace(Regex("[^0-9 ]"), "")
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_a_prompt_that_encodes_to_no_tokens_names_its_row():
    tokenizer = _digits_only_tokenizer()
    assert tokenizer("seven apples", add_special_tokens=False).input_ids == []
    problems = [Problem("a", "7 apples", "7"), Problem("b", "seven apples", "7")]
    with pytest.raises(DataError, match=r"^train.jsonl: line 2: the prompt encodes to no tokens"):
        PromptLimit(tokenizer, 100).apply(problems, ["train.jsonl: line 1", "train.jsonl: line 2"])


def test_a_prompt_with_tokens_passes_the_same_tokenizer():
    problems = [Problem("a", "7 apples", "7")]
    assert PromptLimit(_digits_only_tokenizer(), 100).apply(problems, ["train.jsonl: line 1"])[0] == problems


def test_an_empty_prompt_is_not_this_error():
    class Characters:
        def __call__(self, texts, add_special_tokens=False):
            return type("Encoded", (), {"input_ids": [list(t) for t in texts]})()

    kept = PromptLimit(Characters(), 10).apply([Problem("a", "", "7"), Problem("b", "12", "3")], ["r1", "r2"])[0]
    assert [p.uid for p in kept] == ["a", "b"]
