"""Where a row stops: at a stop token (the options' and every EOS of the model's generation config, as
model.generate and vLLM do) or at max_new_tokens, with the masks, padding and truncation flags that follow, for the
fast engine and `model.generate` alike."""

from __future__ import annotations

import pytest
import torch

from podsrl.engines import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.engines.hf import HFEngine
from tests.conftest import device_under_test
from tests.engines.test_engines import make_model, random_prompts
from tests.tiny_lm import PAD, assert_rows_end_at_their_first_stop, chat_model, chat_request
from tests.tiny_lm import TokStub as Tok

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
def test_stop_tokens_max_new_tokens_and_masks(engine_cls):
    model = make_model("qwen", peak=30.0)
    prompts = random_prompts([3, 6, 4])
    engine = engine_cls(model, Tok())
    greedy = SamplingParams(max_new_tokens=9, greedy=True)
    free = engine.generate(prompts, [1, 1, 1], greedy, torch.arange(3))
    assert free.completion_ids.shape[1] == 9 and free.truncated.all() and free.completion_mask.all()
    stop = int(free.completion_ids[0, 4])  # a token the first row emits at position 4 (maybe earlier too)
    out = engine.generate(
        prompts,
        [1, 1, 1],
        SamplingParams(max_new_tokens=9, greedy=True, stop_token_ids=(stop,)),
        torch.arange(3),
    )
    for r in range(3):
        row = free.completion_ids[r].tolist()
        end = row.index(stop) + 1 if stop in row else 9
        assert out.completion_mask[r].tolist() == [1.0] * end + [0.0] * (out.completion_mask.shape[1] - end)
        assert out.completion_ids[r, :end].tolist() == row[:end]
        assert (out.completion_ids[r, end:] == PAD).all() and (out.logprobs[r, end:] == 0).all()
        assert bool(out.truncated[r]) == (stop not in row)
    assert out.completion_ids.shape[1] == max(int(m.sum()) for m in out.completion_mask)


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
def test_every_eos_of_the_generation_config_stops_a_row(engine_cls):
    """A chat model whose turns end with <|im_end|>, not the tokenizer's EOS: rows stop at either, as with
    model.generate and vLLM; an eos_token_id option still replaces both."""
    model, tokenizer = chat_model()
    model.to(device_under_test())
    im_end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    prompts, counts, seeds = chat_request(tokenizer)
    params = SamplingParams(max_new_tokens=12)
    out = engine_cls(model, tokenizer).generate(prompts, counts, params, seeds)
    ended = assert_rows_end_at_their_first_stop(out, {im_end, eos}, params.max_new_tokens)
    assert ended.get(im_end, 0) > 0 and out.truncated.any()  # rows of both kinds
    only_eos = engine_cls(model, tokenizer, eos_token_id=eos).generate(prompts, counts, params, seeds)
    assert_rows_end_at_their_first_stop(only_eos, {eos}, params.max_new_tokens)
    assert any(im_end in row for row in only_eos.completion_ids.tolist())
