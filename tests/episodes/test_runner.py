"""The episode runner over a scripted engine: a tool call's answer lands in the context, masked from the loss, and
the episode continues; faulty tools become error messages and counted faults; turn and token limits end episodes;
a failing environment ends its episode; an episode depends on its own seed only."""

from __future__ import annotations

import json
import re
import time

import torch

from podsrl.batch import Problem
from podsrl.config import EpisodeConfig
from podsrl.engines.base import SamplingParams
from podsrl.episodes.environment import ToolEnvironment
from podsrl.episodes.runner import EpisodeRunner, turn_seeds
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask
from tests.episodes.scripted import EOS_TEXT, TOKENIZER, ScriptedEngine

PARAMS = SamplingParams(max_new_tokens=200)


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def calculator_script(context: str, seed: int) -> str:
    """First turn: ask the calculator for the prompt's sum (and ramble on past the call); then answer with the last
    tool response."""
    responses = re.findall(r"<tool_response>(.*?)</tool_response>", context)
    if responses:
        return responses[-1] + EOS_TEXT
    expression = context.split("=")[0]
    return call("calculator", expression=expression) + " and more text"


def run(engine, task, problems, counts, seeds, **cfg):
    runner = EpisodeRunner(engine, TOKENIZER, task, EpisodeConfig(**cfg))
    return runner.run(problems, counts, PARAMS, torch.tensor(seeds))


def test_a_tool_answer_lands_in_the_context_masked_from_the_loss_and_the_episode_continues():
    task = ArithmeticToolTask(seed=0, eval_size=0)
    engine = ScriptedEngine(calculator_script)
    problem = Problem(uid="p", prompt="47+8=", answer="55")
    out = run(engine, task, [problem], [2], [11, 12])
    gen = out.generation
    the_call = call("calculator", expression="47+8")
    response = "<tool_response>55</tool_response>"
    expected = the_call + response + "55" + EOS_TEXT
    for row in range(2):
        n = int(gen.completion_mask[row].sum())
        assert TOKENIZER.decode(gen.completion_ids[row, :n]) == expected  # the call ends the turn: no ramble
        mask = out.loss_mask[row, :n].tolist()
        start, end = len(the_call), len(the_call) + len(response)  # char-level: one token a character
        assert mask == [1.0] * start + [0.0] * (end - start) + [1.0] * (n - end)
        assert bool((gen.logprobs[row, start:end] == 0).all()) and bool((gen.logprobs[row, :start] < 0).all())
    assert not bool(gen.truncated.any())
    # the second turn re-prefilled the whole episode so far, the tool's answer in it
    assert engine.calls[1]["contexts"][0] == "47+8=" + the_call + response
    assert [len(c["contexts"]) for c in engine.calls] == [2, 2]
    text = TOKENIZER.decode(gen.completion_ids[0, :int(gen.completion_mask[0].sum())], skip_special_tokens=True)
    assert task.is_correct(text, problem)
    metrics = out.stats.metrics()
    assert metrics["episode/turns"] == 2.0
    assert metrics["episode/tool_calls/calculator"] == 2.0 and metrics["episode/tool_faults"] == 0.0
    assert metrics["episode/ended_by_answer"] == 1.0


def boom(x: int) -> str:
    """Raises.

    Args:
        x: anything.
    """
    raise RuntimeError("tool broke")


def hang(x: int) -> str:
    """Sleeps past any deadline.

    Args:
        x: anything.
    """
    time.sleep(3)
    return "late"


def junk(x: int) -> dict:
    """Returns a mapping, not a string.

    Args:
        x: anything.
    """
    return {"x": x}


class FaultyTask(ArithmeticToolTask):
    def environment(self, tool_timeout_s: float) -> ToolEnvironment:
        return ToolEnvironment([boom, hang, junk], tool_timeout_s)


def faulty_script(context: str, seed: int) -> str:
    """Turn t calls boom, hang, junk, a tool that does not exist, then answers."""
    turn = context.count("<tool_response>")
    if turn < 4:
        return call(["boom", "hang", "junk", "nonesuch"][turn], x=1)
    return "0" + EOS_TEXT


def test_faulty_tools_become_error_messages_and_counted_faults_and_the_episode_goes_on():
    engine = ScriptedEngine(faulty_script)
    start = time.monotonic()
    out = run(engine, FaultyTask(seed=0, eval_size=0), [Problem(uid="p", prompt="1+1=", answer="2")], [1], [3],
              max_turns=6, max_tokens=1000, tool_timeout_s=0.3)
    assert time.monotonic() - start < 2.5  # the hung call was abandoned at its deadline
    context = engine.calls[-1]["contexts"][0]
    for message in ("error: boom raised RuntimeError: tool broke", "error: hang took longer than 0.3 s",
                    "error: junk returned a dict", "error: no tool named 'nonesuch'"):
        assert message in context, message
    metrics = out.stats.metrics()
    assert metrics["episode/turns"] == 5.0 and metrics["episode/ended_by_answer"] == 1.0
    assert metrics["episode/tool_faults"] == 4.0
    for name in ("boom", "hang", "junk", "invalid"):
        assert metrics[f"episode/tool_faults/{name}"] == 1.0 == metrics[f"episode/tool_calls/{name}"]


def test_turn_limit_and_token_budget_end_episodes():
    always_call = lambda context, seed: call("calculator", expression="1+1")  # noqa: E731
    task = ArithmeticToolTask(seed=0, eval_size=0)
    problem = Problem(uid="p", prompt="1+1=", answer="2")
    out = run(ScriptedEngine(always_call), task, [problem], [1], [0], max_turns=3, max_tokens=1000)
    assert out.stats.metrics()["episode/ended_by_turns"] == 1.0 and out.stats.turns == 3
    # the last turn's call is not answered: no turn is left to read it
    assert TOKENIZER.decode(out.generation.completion_ids[0]).endswith("</tool_call>")
    engine = ScriptedEngine(always_call)
    out = run(engine, task, [problem], [1], [0], max_turns=10, max_tokens=150)
    assert out.stats.metrics()["episode/ended_by_tokens"] == 1.0 and bool(out.generation.truncated[0])
    assert int(out.generation.completion_mask[0].sum()) == 150
    # the second turn may generate only what the first turn and the tool's answer left of the budget
    first_turn = len(call("calculator", expression="1+1") + "<tool_response>2</tool_response>")
    assert [c["max_new_tokens"] for c in engine.calls] == [150, 150 - first_turn]
    # and the environment's answer that overflows it is cut at the budget too
    out = run(ScriptedEngine(always_call), task, [problem], [1], [0], max_turns=10, max_tokens=90)
    assert int(out.generation.completion_mask[0].sum()) == 90 and int(out.loss_mask[0].sum()) == 81


def seeded_script(context: str, seed: int) -> str:
    """Calls the tool on odd seeds, answers the seed's last digit on even ones."""
    if seed % 2 and "<tool_response>" not in context:
        return call("calculator", expression="2*3")
    return str(seed % 10) + EOS_TEXT


def test_each_turn_is_seeded_from_the_rows_seed_and_the_turn_alone():
    task = ArithmeticToolTask(seed=0, eval_size=0)
    problems = [Problem(uid=str(i), prompt=f"{i}+1=", answer="0") for i in range(3)]
    seeds = [101, 202, 303]
    engine = ScriptedEngine(seeded_script)
    together = run(engine, task, problems, [1, 1, 1], seeds)
    for turn, c in enumerate(engine.calls):
        live = [0, 1, 2] if turn == 0 else [i for i in range(3) if turn_seeds(torch.tensor(seeds), 0)[i] % 2]
        assert torch.equal(c["seeds"], turn_seeds(torch.tensor(seeds)[live], turn))
    alone = run(ScriptedEngine(seeded_script), task, problems[2:], [1], seeds[2:])
    n = int(alone.generation.completion_mask[0].sum())
    assert torch.equal(together.generation.completion_ids[2, :n], alone.generation.completion_ids[0, :n])
    assert int(together.generation.completion_mask[2].sum()) == n


class BrokenEnvironment(ToolEnvironment):
    def step(self, assistant_text: str):
        raise OSError("environment lost")


class BrokenTask(ArithmeticToolTask):
    def environment(self, tool_timeout_s: float) -> ToolEnvironment:
        return BrokenEnvironment([], tool_timeout_s)


def test_an_environment_that_fails_ends_its_episode_counted_without_stopping_the_run():
    problems = [Problem(uid="p", prompt="47+8=", answer="55")]
    out = run(ScriptedEngine(calculator_script), BrokenTask(seed=0, eval_size=0), problems, [2], [1, 2])
    metrics = out.stats.metrics()
    assert metrics["episode/ended_by_environment_fault"] == 1.0 and metrics["episode/turns"] == 1.0
    assert int(out.loss_mask.sum()) == int(out.generation.completion_mask.sum()) > 0


def test_a_nan_or_infinite_tool_answer_is_a_fault_not_passed_on():
    import numpy as np

    from podsrl.episodes.formats import ToolCall
    from podsrl.episodes.tools import call_tools

    def measure(x: str) -> float:
        """Returns what it is asked for.

        Args:
            x: nan, inf, -inf (as numpy's), or a number.
        """
        return np.float64(x[3:]) if x.startswith("np:") else float(x)

    results = call_tools([ToolCall("measure", {"x": x}) for x in ("nan", "inf", "np:-inf", "2.5")],
                         {"measure": measure}, timeout_s=5.0)
    assert [r.fault for r in results] == [True, True, True, False]
    assert [r.content for r in results] == ["error: measure returned nan, not a finite number",
                                            "error: measure returned inf, not a finite number",
                                            "error: measure returned -inf, not a finite number", "2.5"]
