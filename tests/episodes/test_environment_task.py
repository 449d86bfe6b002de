"""A user's environment class from the config alone (`task.name: environment`, `task.args.factory: file.py:Class`,
problems from a dataset), as reward functions are taken from files: its episodes run, each scored by its own
environment (its `reward()`, or the sum of its steps' turn rewards), a ToolEnvironment subclass gets the run's tool
timeout and call format; a bad factory stops the run naming the file and the class (tests/faults/test_bad_inputs.py
runs those through the CLI: exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from podsrl.config import load_config
from podsrl.errors import ConfigError
from podsrl.run.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.episodes.scripted import EOS_TEXT, ScriptedEngine
from tests.episodes.test_episode_task import train_two_episode_steps
from tests.episodes.test_runner import call

ENVS = Path(__file__).resolve().parents[1] / "fixtures" / "countdown_env.py"


def overrides(tmp_path, warmup_cache, cls: str, rows: list[dict], **extra) -> list[str]:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    args = {"path": str(data), "factory": f"{ENVS}:{cls}", **extra.pop("args", {})}
    return tiny_overrides(tmp_path, warmup_cache, **{
        "task.name": "environment", "task.args": json.dumps(args), "warmup.steps": 0, "task.eval_size": 0,
        "model.tiny.max_position_embeddings": 160, "rollout.max_new_tokens": 16, "episode.max_tokens": 128,
        "episode.max_turns": 4, **extra})


COUNTDOWNS = [{"prompt": "countdown", "answer": n} for n in (2, 3, 4) for _ in range(4)]


def count_down(context: str, seed: int) -> str:
    """The right next number, except on odd seeds at the second turn (one right turn, then a wrong one)."""
    start = int(re.search(r"from (\d+),", context).group(1))
    said = context.count("Next one.")
    wrong = seed % 2 == 1 and said == 1
    return str(start + 5 if wrong else start - 1 - said) + EOS_TEXT


def test_a_countdown_environment_is_scored_by_its_turn_rewards(tmp_path, warmup_cache):
    trainer = Trainer(load_config(None, overrides(tmp_path, warmup_cache, "Countdown", COUNTDOWNS,
                                                  args={"env_args": {"say": "Count down from"}})))
    assert trainer.parts.task.name == "environment:Countdown"
    trainer.parts.producer.episodes.engine = ScriptedEngine(count_down)
    produced = trainer.parts.producer.produce(0)
    seen = 0
    for batch in produced.generated:
        for row, completion in enumerate(batch.completions):
            start = int(batch.problems[int(batch.group_index[row])].answer)
            full = completion.endswith("Next one.0")  # every number said, down to 0
            want = 1.0 if full else 1.0 / start  # the sum of its turn rewards: all of them, or the first only
            assert float(batch.reward_components["correct"][row]) == pytest.approx(want), completion
            seen += 1
    correct = [float(r) for b in produced.generated for r in b.reward_components["correct"]]
    assert seen and 1.0 in correct and min(correct) < 1.0  # both kinds of episode occurred
    trainer.close_engines()


@pytest.mark.slow  # about 15 s on a shared 2-core machine
def test_a_tiny_trainer_trains_two_steps_in_an_environment_from_a_file(tmp_path, warmup_cache):
    train_two_episode_steps(tmp_path, overrides(tmp_path, warmup_cache, "Countdown", COUNTDOWNS))


def ask_the_calculator(context: str, seed: int) -> str:
    a, b = map(int, re.match(r"(\d+)\+(\d+)=", context).groups())
    if "<tool_response>" in context:
        return str(a + b + seed % 2) + EOS_TEXT  # wrong on odd seeds, whatever the tool said
    return call("calculator", expression=f"{a}+{b}")


def test_a_tool_environment_subclass_gets_the_runs_tool_timeout_and_scores_itself(tmp_path, warmup_cache):
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(1, 5) for b in range(1, 4)]
    trainer = Trainer(load_config(None, overrides(tmp_path, warmup_cache, "CalculatorEnv", rows,
                                                  **{"rollout.max_new_tokens": 96, "episode.tool_timeout_s": 7})))
    assert trainer.parts.task.environment(7.0).env.tool_timeout_s == 7.0
    trainer.parts.producer.episodes.engine = ScriptedEngine(ask_the_calculator)
    produced = trainer.parts.producer.produce(0)
    correct = [float(r) for b in produced.generated for r in b.reward_components["correct"]]
    assert 0 < sum(correct) < len(correct)
    assert produced.metrics["episode/tool_calls/calculator"] == len(correct)  # the calls ran, one per episode
    trainer.close_engines()


@pytest.mark.parametrize("factory, message", [
    ("missing_env.py:Countdown", "task.args.factory: file '{dir}/missing_env.py' not found"),
    ("countdown_env.py:Nope", "task.args.factory: '{dir}/countdown_env.py' has no attribute 'Nope'"),
    ("countdown_env.py:NoStep", "task.args.factory: '{dir}/countdown_env.py:NoStep' gives a NoStep without a step"),
])
def test_a_bad_factory_is_refused_naming_the_file_and_the_class(tmp_path, warmup_cache, factory, message):
    args = overrides(tmp_path, warmup_cache, "Countdown", COUNTDOWNS)
    args = [a.replace(f"{ENVS}:Countdown", f"{ENVS.parent}/{factory}") for a in args]
    with pytest.raises(ConfigError) as raised:
        Trainer(load_config(None, args))
    assert message.format(dir=ENVS.parent) in str(raised.value)


def test_env_args_the_class_does_not_take_are_refused_naming_them(tmp_path, warmup_cache):
    args = overrides(tmp_path, warmup_cache, "Countdown", COUNTDOWNS, args={"env_args": {"colour": "red"}})
    with pytest.raises(ConfigError, match=r"task.args.factory: .*countdown_env.py:Countdown' cannot be called with "
                                          r"\{'colour': 'red'\} \(task.args.env_args\)"):
        Trainer(load_config(None, args))
