"""The calculator evaluates integer +, -, * and refuses anything else; an episode's messages render through the
chat template (the environment's messages as what the template writes after an assistant turn, its tools' schemas
in the prompt), and a turn runs on past a one-token </tool_call> to the model's end of turn."""

from __future__ import annotations

import pytest

from podsrl.config import EpisodeConfig
from podsrl.episodes.render import EpisodeRenderer
from podsrl.episodes.runner import EpisodeRunner
from podsrl.models.loading import build_char_tokenizer
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask, calculator
from tests.tiny_lm import CHAT_TEMPLATE

TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>\n"
                 "{% endif %}" + CHAT_TEMPLATE)


def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def test_calculator_evaluates_integer_expressions_and_refuses_the_rest():
    assert calculator("47+8*(3-1)") == "63" and calculator(" -5*2 ") == "-10"
    for bad in ("2**8", "__import__('os')", "1/2", "1.5+1", "x+1", "9" * 65):
        with pytest.raises(ValueError):
            calculator(bad)


def test_the_prompt_carries_the_tools_and_a_turn_continues_after_its_stop_token():
    tokenizer = chat_tokenizer()
    renderer = EpisodeRenderer(tokenizer, [calculator])
    prompt = tokenizer.decode(renderer.prompt([{"role": "user", "content": "47+8="}]))
    assert '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>user\n47+8=<|im_end|>\n"
                                                                "<|im_start|>assistant\n")
    tool = [{"role": "tool", "name": "calculator", "content": "55"}]
    after = "\n<|im_start|>tool\n55<|im_end|>\n<|im_start|>assistant\n"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(renderer.continuation(tool, im_end)) == after  # the model wrote <|im_end|> already
    # a turn that stopped at </tool_call> gets the template's end of turn from the environment
    call_end = tokenizer.convert_tokens_to_ids("</tool_call>")
    assert tokenizer.decode(renderer.continuation(tool, call_end)) == "<|im_end|>" + after
    assert tokenizer.decode(renderer.continuation(tool, None)) == "<|im_end|>" + after


def test_a_turn_runs_on_past_a_one_token_call_end_to_the_models_end_of_turn():
    tokenizer = chat_tokenizer()
    runner = EpisodeRunner(None, tokenizer, ArithmeticToolTask(seed=0, eval_size=0), EpisodeConfig())
    assert runner.stop_ids == ()  # </tool_call> is one token, but a turn may hold several calls: EOS ends it
