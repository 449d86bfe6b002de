"""The one place podsrl meets transformers' moving internals: the cache argument found by capability, and a
Llama-family model whose layout cannot be found stops with one line instead of a quiet slow path."""

import pytest
import torch
import transformers

from podsrl.engines import build_engine
from podsrl.models.packed import packed_forward_problem
from podsrl.models.transformers_api import (
    FastPathUnavailable,
    cache_argument,
    forward_with_cache,
    llama_layout_problem,
    new_dynamic_cache,
)
from tests.tiny_lm import TokStub as Tok
from tests.tiny_lm import tiny_causal_lm

VOCAB = 64


class OlderForward(torch.nn.Module):
    """A causal LM whose forward names its cache as transformers did up to 5.23."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
        self.calls.append(past_key_values)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          **{cache_argument(self.model): past_key_values}, use_cache=use_cache)


def test_cache_argument_is_found_by_capability_under_either_name():
    model = tiny_causal_lm(VOCAB, kind="qwen")
    assert cache_argument(model) in ("cache", "past_key_values")
    older = OlderForward(model)
    assert cache_argument(older) == "past_key_values"
    cache = new_dynamic_cache(model)
    ids = torch.tensor([[3, 4, 5]])
    logits = forward_with_cache(older, cache, input_ids=ids).logits
    assert older.calls == [cache] and cache.get_seq_length() == 3  # the cache was filled through the old name
    # one more token through the cache gives the same logits as the whole sequence at once
    step = forward_with_cache(older, cache, input_ids=torch.tensor([[6]]), position_ids=torch.tensor([[3]])).logits
    full = model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits
    torch.testing.assert_close(torch.cat([logits, step], 1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="takes no KV cache"):
        forward_with_cache(torch.nn.Linear(2, 2), cache, input=torch.ones(2))


def moved_rotary(kind: str):
    """A Llama-family model as a transformers release that moved the rotary embedding would build it."""
    model = tiny_causal_lm(VOCAB, kind=kind)
    del model.model.rotary_emb
    return model


@pytest.mark.parametrize("kind", ["qwen", "llama"])
def test_moved_internal_stops_the_fast_engine_with_one_line(kind):
    model = moved_rotary(kind)
    assert "rotary_emb" in llama_layout_problem(model)
    with pytest.raises(FastPathUnavailable) as error:
        build_engine("fast", model, Tok())
    message = str(error.value)
    assert transformers.__version__ in message and "rotary_emb" in message and "layer_loop: false" in message
    assert "\n" not in message


def test_moved_internal_stops_the_shared_prompt_update_with_one_line():
    with pytest.raises(FastPathUnavailable, match="update.shared_prompt: false"):
        packed_forward_problem(moved_rotary("qwen"))
    assert packed_forward_problem(tiny_causal_lm(VOCAB, kind="qwen")) is None
