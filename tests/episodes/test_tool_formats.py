"""Tool-call formats from real chat templates (tests/fixtures/chat_templates: the tokenizer_config.json files of
Qwen2.5, Qwen3, Llama 3.3 (Llama 3.1's template) and Mistral Nemo, their special tokens added to the char-level
tokenizer): each template names its format, shows the model its tools, and an episode whose model writes calls in
that family's format is answered as the template renders tool responses. The whole episode's text is the template's
own rendering of the same conversation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from podsrl.batch import Problem
from podsrl.config import EpisodeConfig
from podsrl.engines.base import SamplingParams
from podsrl.episodes.formats import FORMATS, InvalidCall, ToolCall, detect_format
from podsrl.episodes.runner import EpisodeRunner
from podsrl.models.loading import build_char_tokenizer
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask, calculator
from tests.episodes.scripted import ScriptedEngine

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
PROBLEM = Problem(uid="p", prompt="47+8+6=", answer="61")
CALLS = [{"expression": "47+8"}, {"expression": "55+6"}]


def fixture_tokenizer(name: str):
    """The char-level tokenizer with the family's added tokens (special or not, as the file says), its EOS and BOS
    and its chat template."""
    config = json.loads((TEMPLATES / name).read_text())
    tokenizer = build_char_tokenizer()
    added = [t for _, t in sorted(config["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))]
    tokenizer.add_special_tokens({"additional_special_tokens": [t["content"] for t in added if t["special"]]})
    tokenizer.add_tokens([t["content"] for t in added if not t["special"]])
    tokenizer.eos_token = config["eos_token"]
    if config["bos_token"]:
        tokenizer.bos_token = config["bos_token"]
    tokenizer.chat_template = config["chat_template"]
    return tokenizer


def hermes_turn(thinking: bool = False) -> str:
    think = '<think>\nAdd. <tool_call>\n{"name": "nonesuch", "arguments": {}}\n</tool_call>\n</think>\n\n' \
        if thinking else ""
    return think + "\n".join(f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps(a)}}}\n</tool_call>'
                             for a in CALLS)


def llama_turn() -> str:
    return json.dumps({"name": "calculator", "parameters": CALLS[0]})


def mistral_turn() -> str:
    ids = ["a1b2c3d4e", "f5g6h7i8j"]
    return "[TOOL_CALLS][" + ", ".join(json.dumps({"name": "calculator", "arguments": a, "id": i})
                                       for a, i in zip(CALLS, ids)) + "]"


def tool_calls(arguments: list[dict], ids: list[str] | None = None) -> list[dict]:
    return [{"type": "function", "function": {"name": "calculator", "arguments": a}, **({"id": i} if ids else {})}
            for a, i in zip(arguments, ids or [None] * len(arguments))]


# (fixture, format, the model's first turn, the calls the template renders, the ids they carry)
FAMILIES = {
    "qwen2.5": ("qwen2.5-7b-instruct.json", "hermes", hermes_turn(), CALLS, None),
    "qwen3": ("qwen3-0.6b.json", "hermes", hermes_turn(thinking=True), CALLS, None),
    "llama3": ("llama-3.3-70b-instruct.json", "llama3_json", llama_turn(), CALLS[:1], None),
    "mistral": ("mistral-nemo-instruct-2407.json", "mistral", mistral_turn(), CALLS, ["a1b2c3d4e", "f5g6h7i8j"]),
}


def run_family(family: str):
    name, _, first_turn, _, _ = FAMILIES[family]
    tokenizer = fixture_tokenizer(name)

    def script(context: str, seed: int) -> str:  # calls, then the answer once the calls are in the context
        return ("61" if first_turn in context else first_turn) + tokenizer.eos_token

    engine = ScriptedEngine(script, tokenizer)
    runner = EpisodeRunner(engine, tokenizer, ArithmeticToolTask(seed=0, eval_size=0),
                           EpisodeConfig(max_turns=3, max_tokens=4000))
    return tokenizer, engine, runner, runner.run([PROBLEM], [1], SamplingParams(max_new_tokens=1000),
                                                 torch.tensor([5]))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_template_names_its_format_and_shows_the_model_its_tools(family):
    name, fmt, *_ = FAMILIES[family]
    tokenizer = fixture_tokenizer(name)
    assert detect_format(tokenizer.chat_template) is FORMATS[fmt]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROBLEM.prompt}], tools=[calculator],
                                           tokenize=False, add_generation_prompt=True)
    assert '"name": "calculator"' in prompt and "integer expression" in prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_an_episode_in_the_familys_format_is_the_templates_own_rendering_of_its_conversation(family):
    name, fmt, first_turn, calls, ids = FAMILIES[family]
    tokenizer, engine, runner, out = run_family(family)
    assert runner.tool_format is FORMATS[fmt]
    assert out.stats.tool_calls["calculator"] == len(calls) and not sum(out.stats.tool_faults.values())
    assert out.stats.endings["answer"] == 1 and out.stats.turns == 2
    answers = [calculator(**a) for a in calls]
    conversation = [{"role": "user", "content": PROBLEM.prompt},
                    {"role": "assistant", "content": "", "tool_calls": tool_calls(calls, ids)},
                    *[{"role": "tool", "name": "calculator", "content": a, **({"tool_call_id": i} if ids else {})}
                      for a, i in zip(answers, ids or [None] * len(answers))]]
    expected = tokenizer.apply_chat_template(conversation, tools=[calculator], tokenize=False,
                                             add_generation_prompt=True)
    context = engine.calls[1]["contexts"][0]  # the second turn's: prompt, first turn, the tools' answers
    if family == "qwen3":  # its template writes a turn's thinking apart from its calls: the responses follow it
        assert context == (engine.calls[0]["contexts"][0] + first_turn + "<|im_end|>\n<|im_start|>user\n"
                           "<tool_response>\n55\n</tool_response>\n<tool_response>\n61\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")
    else:
        assert context == expected
    # the model's tokens are its two turns; the template's end of turn after them is not repeated
    n = int(out.generation.completion_mask[0].sum())
    model_text = tokenizer.decode(out.generation.completion_ids[0, :n][out.loss_mask[0, :n] > 0])
    assert model_text == first_turn + tokenizer.eos_token + "61" + tokenizer.eos_token


def test_qwen3_thinks_a_call_without_making_it():
    assert FORMATS["hermes"].parse(hermes_turn(thinking=True)) == [ToolCall("calculator", a) for a in CALLS]


def test_llama_reads_calls_after_the_python_tag_or_plain_and_ends_a_turn_at_eom():
    llama = FORMATS["llama3_json"]
    call = ToolCall("calculator", CALLS[0])
    assert llama.parse("<|python_tag|>" + llama_turn()) == [call] == llama.parse(" " + llama_turn())
    assert llama.parse(llama_turn() + "; " + llama_turn()) == [call, call]
    assert llama.parse("The sum is 61.") == []
    tokenizer = fixture_tokenizer(FAMILIES["llama3"][0])
    runner = EpisodeRunner(None, tokenizer, ArithmeticToolTask(seed=0, eval_size=0), EpisodeConfig())
    assert runner.stop_ids == (tokenizer.convert_tokens_to_ids("<|eom_id|>"),)


def test_mistral_reads_its_calls_with_or_without_the_special_token_and_answers_with_their_ids():
    mistral = FORMATS["mistral"]
    text = mistral_turn()
    assert mistral.parse(text) == mistral.parse(text.removeprefix("[TOOL_CALLS]"))
    assert [c.id for c in mistral.parse(text)] == ["a1b2c3d4e", "f5g6h7i8j"]
    assert mistral.tool_message(mistral.parse(text)[0], "calculator", "55", 0)["tool_call_id"] == "a1b2c3d4e"
    made = mistral.tool_message(ToolCall("calculator", {}), "calculator", "55", 3)["tool_call_id"]
    assert len(made) == 9 and made.isalnum()  # the template refuses any other id
    assert mistral.parse("[1, 2] is the list") == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_malformed_call_in_any_format_is_an_invalid_call(fmt):
    write = {"hermes": lambda body: f"<tool_call>{body}</tool_call>", "llama3_json": lambda body: body,
             "mistral": lambda body: f"[TOOL_CALLS][{body}]"}[fmt]
    bodies = ['{"name": ["calculator"], "arguments": {}}', '{"name": {"a": 1}, "arguments": {}}',
              "[" * 5000 + "]" * 5000 if fmt != "llama3_json" else '{"name": ' + "[" * 5000 + "]" * 5000 + "}",
              '{"name": "calculator", "arguments": {"expression": ' + "9" * 5000 + "}}",
              '{"name": "calculator", "arguments": [1]}', '{"name": "calculator", "arguments": {"a": 1}']
    for body in bodies:
        calls = FORMATS[fmt].parse(write(body))
        assert len(calls) >= 1 and all(isinstance(c, InvalidCall) for c in calls), (fmt, body[:60], calls)


def test_auto_reads_hermes_without_a_template_and_a_named_format_wins():
    from podsrl.episodes.formats import format_for

    assert format_for(build_char_tokenizer()) is FORMATS["hermes"]
    assert format_for(fixture_tokenizer(FAMILIES["qwen2.5"][0]), "mistral") is FORMATS["mistral"]
