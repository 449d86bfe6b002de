"""Environments and tools as users write them, over a scripted engine: a hanging reset, step or tool ends its
episode (or answers the model) at its time limit, named once; hung calls are capped; a stop request abandons the
episodes at once; wrong shapes stop the run naming the class, the method and the value; malformed calls and
SystemExit are answered to the model as what they are; the calls of a turn run concurrently and are answered in
order; long answers are cut before tokenizing; an episode ends at the model's context."""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import pytest
import torch

from podsrl.batch import Problem
from podsrl.config import EpisodeConfig
from podsrl.engines.base import SamplingParams
from podsrl.episodes.adapters.trl import TRLEnvironment
from podsrl.episodes.calls import CALLS, STOP, HungCalls, Interrupted
from podsrl.episodes.environment import EnvironmentShapeError, ToolEnvironment, checked_step
from podsrl.episodes.runner import EpisodeRunner
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask, calculator
from tests.episodes.scripted import EOS_TEXT, TOKENIZER, ScriptedEngine

PARAMS = SamplingParams(max_new_tokens=400)
PROBLEM = Problem(uid="p", prompt="47+8=", answer="55")
RELEASE = threading.Event()  # what every hanging call waits for: set when the module's tests are done


@pytest.fixture(autouse=True, scope="module")
def release_hung_calls():
    yield
    RELEASE.set()


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def calls_then_answer(*turn: str):
    """A script: the turn's calls (and EOS), then, once a tool response is in the context, the last one."""
    def script(context: str, seed: int) -> str:
        responses = re.findall(r"<tool_response>(.*?)</tool_response>", context, re.DOTALL)
        return (responses[-1][:3] if responses else "".join(turn)) + EOS_TEXT
    return script


class Task(ArithmeticToolTask):
    def __init__(self, make) -> None:
        super().__init__(seed=0, eval_size=0)
        self.make = make

    def environment(self, tool_timeout_s: float):
        return self.make(tool_timeout_s)


def run(make, script=None, episodes: int = 1, context: int | None = None, **cfg):
    engine = ScriptedEngine(script or calls_then_answer(call("calculator", expression="47+8")))
    runner = EpisodeRunner(engine, TOKENIZER, Task(make), EpisodeConfig(**{"max_tokens": 4000, **cfg}), context)
    return engine, runner.run([PROBLEM], [episodes], PARAMS, torch.arange(episodes))


class HangingStep(ToolEnvironment):
    def step(self, assistant_text: str):
        RELEASE.wait()
        return [], True


class HangingReset(ToolEnvironment):
    def reset(self, problem: Problem):
        RELEASE.wait()
        return super().reset(problem)


class SlowStep(ToolEnvironment):
    def step(self, assistant_text: str):
        time.sleep(0.15)
        return [{"role": "tool", "name": "slow", "content": "1"}], False


def test_a_hanging_step_ends_its_episodes_at_the_time_limit_with_one_warning(caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        _, out = run(lambda t: HangingStep([calculator], t), episodes=3, env_timeout_s=0.3)
    assert time.monotonic() - start < 3
    assert out.stats.endings["timeout"] == 3 and out.stats.metrics()["episode/ended_by_timeout"] == 1.0
    warnings = [r.getMessage() for r in caplog.records if "HangingStep.step" in r.getMessage()]
    assert len(warnings) == 1 and "episode.env_timeout_s=0.3" in warnings[0] and "3 of 3" in warnings[0]
    assert int(out.loss_mask.sum()) > 0  # the turn before the hang is kept and trains


def test_a_hanging_reset_ends_its_episode_before_any_turn(caplog):
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        engine, out = run(lambda t: HangingReset([calculator], t), env_timeout_s=0.3)
    assert out.stats.endings["timeout"] == 1 and out.stats.turns == 0 and not engine.calls
    assert TOKENIZER.decode(out.generation.prompt_ids[0][out.generation.prompt_mask[0] > 0]) == PROBLEM.prompt
    assert any("HangingReset.reset" in r.getMessage() for r in caplog.records)


def test_an_episode_ends_once_its_environment_time_passes_the_episode_limit():
    always = lambda context, seed: "x" + EOS_TEXT  # noqa: E731 - every turn steps the slow environment
    _, out = run(lambda t: SlowStep([], t), script=always, max_turns=20, env_timeout_s=5, timeout_s=0.4)
    assert out.stats.endings["timeout"] == 1 and 2 <= out.stats.turns <= 4


class TRLHangingReset:
    def reset(self, **row):
        RELEASE.wait()

    def get_reward(self) -> float:
        return 0.0


def test_a_trl_environments_reset_runs_under_the_time_limit_named_by_its_class(caplog):
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        _, out = run(lambda t: TRLEnvironment(TRLHangingReset(), t), env_timeout_s=0.3)
    assert out.stats.endings["timeout"] == 1
    assert any("TRLHangingReset.reset" in r.getMessage() for r in caplog.records)


def hang(x: int) -> str:
    """Never returns (until the tests are over).

    Args:
        x: anything.
    """
    RELEASE.wait()
    return "late"


def test_tools_that_keep_hanging_stop_the_run_naming_the_tool():
    before = CALLS.hung
    make = lambda t: ToolEnvironment([hang], t)  # noqa: E731
    with pytest.raises(HungCalls, match=r"hang: \d+.*episode.max_hung_calls \(" + str(before + 2) + r"\)"):
        run(make, script=calls_then_answer(call("hang", x=1)), episodes=3 + before, tool_timeout_s=0.2,
            max_hung_calls=before + 2)


def exits(code: int) -> str:
    """Exits the interpreter, or tries to.

    Args:
        code: the exit code.
    """
    raise SystemExit(code) if code else KeyboardInterrupt


def test_systemexit_and_keyboardinterrupt_in_a_tool_are_reported_as_what_they_are():
    start = time.monotonic()
    engine, out = run(lambda t: ToolEnvironment([exits], t),
                      script=calls_then_answer(call("exits", code=3), call("exits", code=0)), tool_timeout_s=5)
    assert time.monotonic() - start < 2  # not waited for as a timeout
    context = engine.calls[1]["contexts"][0]
    assert "error: exits raised SystemExit: 3" in context and "error: exits raised KeyboardInterrupt" in context
    assert out.stats.tool_faults["exits"] == 2


class Returns(ToolEnvironment):
    value = None

    def step(self, assistant_text: str):
        return self.value


class ResetReturns(ToolEnvironment):
    def reset(self, problem: Problem):
        return "47+8="


@pytest.mark.parametrize("value", ["done", ([], "yes"), ({"role": "tool", "content": "1"}, False),
                                   ([{"role": "tool", "content": 55}], False), ([], True, "high"), ([],)])
def test_a_step_of_the_wrong_shape_stops_the_run_naming_the_class_the_method_and_the_value(value):
    make = lambda t: type("Returns", (Returns,), {"value": value})([], t)  # noqa: E731
    with pytest.raises(EnvironmentShapeError, match=r"Returns\.step returned .*\(a (str|tuple)\); it returns "
                                                    r"\(messages, done\) or \(messages, done, reward\)"):
        run(make)


def test_a_reset_of_the_wrong_shape_is_named_and_both_step_shapes_are_taken():
    with pytest.raises(EnvironmentShapeError, match=r"ResetReturns\.reset returned '47\+8=' \(a str\)"):
        run(lambda t: ResetReturns([], t))
    for value in (([], True), ([], True, 0.5), ([], True, None)):
        _, out = run(lambda t, value=value: type("Returns", (Returns,), {"value": value})([], t))
        assert out.stats.endings["answer"] == 1
    assert checked_step("E.step", ([], False, 1)) == ([], False, 1.0) and checked_step("E.step", ([], True)) == (
        [], True, None)


class TRLNumberReset:
    def reset(self, **row):
        return 7

    def get_reward(self) -> float:
        return 0.0


def test_a_trl_reset_of_the_wrong_shape_is_named_by_its_class():
    with pytest.raises(EnvironmentShapeError, match=r"TRLNumberReset\.reset returned 7 \(a int\)"):
        run(lambda t: TRLEnvironment(TRLNumberReset(), t))


def test_a_malformed_call_is_answered_as_invalid_and_the_episode_goes_on():
    bad = '<tool_call>{"name": ["calculator"], "arguments": {}}</tool_call>'
    deep = "<tool_call>" + "[" * 100 + "]" * 100 + "</tool_call>"  # 5,000 deep: test_tool_formats.py
    engine, out = run(lambda t: ToolEnvironment([calculator], t), script=calls_then_answer(bad, deep))
    context = engine.calls[1]["contexts"][0]
    assert "error: a tool call's name is a string, not list" in context and "nests deeper than 64" in context
    assert out.stats.tool_faults["invalid"] == 2 and out.stats.endings["answer"] == 1


CONCURRENT = {"now": 0, "most": 0}
LOCK = threading.Lock()


def slow_add(a: int, b: int) -> str:
    """Adds slowly, counting the calls running at once.

    Args:
        a: one integer.
        b: another.
    """
    with LOCK:
        CONCURRENT["now"] += 1
        CONCURRENT["most"] = max(CONCURRENT["most"], CONCURRENT["now"])
    time.sleep(0.3)
    with LOCK:
        CONCURRENT["now"] -= 1
    return str(a + b)


@pytest.mark.parametrize("parallel", [3, 1])
def test_three_calls_of_one_turn_run_concurrently_and_are_answered_in_order(parallel):
    CONCURRENT.update(now=0, most=0)
    turn = [call("slow_add", a=i, b=100) for i in (1, 2, 3)]
    engine, out = run(lambda t: ToolEnvironment([slow_add], t), script=calls_then_answer(*turn),
                      max_parallel_calls=parallel)
    assert CONCURRENT["most"] == parallel
    context = engine.calls[1]["contexts"][0]
    assert context == PROBLEM.prompt + "".join(turn) + "".join(f"<tool_response>{v}</tool_response>"
                                                               for v in (101, 102, 103))
    assert out.stats.tool_calls["slow_add"] == 3 and out.stats.turns == 2  # one turn held the three calls


def tells_all(n: int) -> str:
    """Returns n characters.

    Args:
        n: how many.
    """
    return "a" + "b" * (n - 2) + "z"


@pytest.mark.parametrize("side, expected", [("left", "ab" + "b" * 84 + "...(truncated)"),
                                            ("right", "(truncated)..." + "b" * 85 + "z"),
                                            ("middle", "a" + "b" * 40 + "...(truncated)..." + "b" * 41 + "z")])
def test_a_long_answer_is_cut_before_tokenizing_and_counted(side, expected):
    engine, out = run(lambda t: ToolEnvironment([tells_all], t), script=calls_then_answer(call("tells_all", n=100_000)),
                      max_response_chars=100, response_truncate_side=side)
    response = re.findall(r"<tool_response>(.*?)</tool_response>", engine.calls[1]["contexts"][0])[0]
    assert response == expected and len(response) == 100
    assert out.stats.metrics()["episode/truncated_responses"] == 1.0


class Verbose(ToolEnvironment):
    def step(self, assistant_text: str):
        return [{"role": "tool", "name": "v", "content": "x" * 10_000}], False


def test_an_environments_own_long_message_is_cut_and_counted_too():
    engine, out = run(lambda t: Verbose([], t), script=lambda c, s: "go" + EOS_TEXT, max_turns=2,
                      max_response_chars=64)
    assert len(re.findall(r"<tool_response>(.*?)</tool_response>", engine.calls[1]["contexts"][0])[0]) == 64
    assert out.stats.truncated_responses == 1


def test_an_episode_ends_at_the_models_context():
    always = lambda context, seed: call("calculator", expression="1+1") + EOS_TEXT  # noqa: E731
    engine, out = run(lambda t: ToolEnvironment([calculator], t), script=always, max_turns=10, context=120)
    assert out.stats.endings["context"] == 1 and out.stats.metrics()["episode/ended_by_context"] == 1.0
    assert len(PROBLEM.prompt) + int(out.generation.completion_mask[0].sum()) == 120
    assert all(len(c) <= 120 for call_ in engine.calls for c in call_["contexts"])


def test_a_stop_request_abandons_the_episodes_at_once():
    timer = threading.Timer(0.3, STOP.set)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            run(lambda t: HangingStep([calculator], t), env_timeout_s=60)
    finally:
        STOP.clear()
    assert time.monotonic() - start < 1.5


def test_an_episode_budget_beyond_the_models_context_is_refused_at_start_up_naming_both_numbers():
    from podsrl.build import load_task
    from podsrl.config import load_config
    from podsrl.errors import ConfigError
    from podsrl.models.loading import build_char_tokenizer, build_tiny_model

    cfg = load_config(None, ["task.name=arithmetic_tool", "model.tiny.max_position_embeddings=160",
                             "episode.max_tokens=4000", "task.eval_size=4"])
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg.model.tiny, tokenizer)
    with pytest.raises(ConfigError, match=r"episode.max_tokens: 4000 leaves no room for a prompt in the model's "
                                          r"context of 160 tokens"):
        load_task(cfg, tokenizer, model)
    load_task(load_config(None, ["task.name=arithmetic_tool", "model.tiny.max_position_embeddings=160",
                                 "episode.max_tokens=128", "task.eval_size=4"]), tokenizer, model)
