"""A user's TRL environment (the class `GRPOTrainer(environment_factory=...)` takes, TRL 1.16) runs as a podsrl
episode: the adapter's prompt, tools, steps, end and reward are what the environment itself gives; a tiny Trainer
trains 2 steps on it; each episode's reward is its own environment's `get_reward()`, and reward functions read the
episodes' environments as TRL's do.

TRL's environments are plain classes, so neither the adapter nor these tests need TRL, except the check that the
installed TRL still takes them."""

from __future__ import annotations

import inspect
import json
import re

import pytest

from podsrl.batch import Problem
from podsrl.config import load_config
from podsrl.episodes.adapters.trl import TRLEnvironment
from podsrl.errors import ConfigError
from podsrl.run.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.episodes.scripted import EOS_TEXT, ScriptedEngine
from tests.episodes.test_episode_task import train_two_episode_steps
from tests.episodes.test_runner import call


class AdderEnv:
    """Written in TRL's API: `reset(**row)` returns text appended to the prompt, the public methods are the tools,
    `get_reward()` scores the episode from the environment's state."""

    def __init__(self) -> None:
        self.answer, self.sums = None, []

    def reset(self, answer: str, **row) -> str:
        self.answer, self.sums = answer, []
        return " Use add."

    def add(self, a: int, b: int) -> str:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.sums.append(a + b)
        return str(a + b)

    def get_reward(self) -> float:
        return 1.0 if self.sums and str(self.sums[-1]) == self.answer else 0.0

    def _helper(self) -> None:  # private: not a tool
        pass

    @property
    def calls(self) -> int:  # a property: not a tool, and not evaluated when the tools are listed
        return len(self.sums)


class NoReward:
    def reset(self, **row) -> None:
        return None


PROBLEM = Problem(uid="0", prompt="3+4=", answer="7", metadata={"level": 1})


def test_the_adapter_gives_what_the_trl_environment_gives():
    direct = AdderEnv()
    adapted = TRLEnvironment(AdderEnv(), tool_timeout_s=5.0)
    assert [f.__name__ for f in adapted.tools] == ["add"]

    observation = direct.reset(prompt=PROBLEM.prompt, answer=PROBLEM.answer, level=1)
    assert adapted.reset(PROBLEM) == [{"role": "user", "content": "3+4=" + observation}]

    messages, done = adapted.step("I will add. " + call("add", a=3, b=4))
    assert (messages, done) == ([{"role": "tool", "name": "add", "content": direct.add(3, 4)}], False)
    assert adapted.env.sums == direct.sums == [7]
    assert adapted.step("7") == ([], True)  # a turn without a call is the answer
    assert adapted.reward() == direct.get_reward() == 1.0

    adapted.reset(PROBLEM)  # a new episode starts from the environment's reset state
    assert adapted.tool_results == [] and adapted.env.sums == []
    adapted.step(call("add", a=3, b=5))
    assert adapted.reward() == 0.0


def test_a_tool_that_raises_is_answered_and_counted():
    adapted = TRLEnvironment(AdderEnv(), tool_timeout_s=5.0)
    adapted.reset(PROBLEM)
    messages, done = adapted.step(call("add", a=3))
    assert not done and messages[0]["content"].startswith("error: add raised TypeError")
    assert [r.fault for r in adapted.tool_results] == [True]


def write_rows(path) -> str:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(1, 5) for b in range(1, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_overrides(tmp_path, warmup_cache, **extra) -> list[str]:
    args = {"path": write_rows(tmp_path / "sums.jsonl"), "environment": f"{__name__}:AdderEnv"}
    return tiny_overrides(tmp_path, warmup_cache, **{
        "task.name": "trl_environment", "task.args": json.dumps(args), "warmup.steps": 0,
        "model.tiny.max_position_embeddings": 160, "rollout.max_new_tokens": 16, "episode.max_tokens": 128,
        "episode.max_turns": 3, **extra})


def test_a_tiny_trainer_runs_two_steps_in_a_trl_environment(tmp_path, warmup_cache):
    train_two_episode_steps(tmp_path, run_overrides(tmp_path, warmup_cache))


def add_right_on_even_seeds(context: str, seed: int) -> str:
    """Asks `add` for the prompt's sum (off by one on odd seeds), then answers the right sum whatever the tool said:
    only the environment's state tells the episodes apart, not their answers."""
    a, b = map(int, re.match(r"(\d+)\+(\d+)=", context).groups())
    if "<tool_response>" in context:
        return str(a + b) + EOS_TEXT
    return call("add", a=a, b=b + seed % 2)


def sums_taken(prompts, completions, environments, **columns) -> list[float]:
    """A reward function reading the episodes' environments, as TRL's reward functions do."""
    return [float(len(e.env.sums)) for e in environments]


def test_each_episode_is_rewarded_by_its_own_environment(tmp_path, warmup_cache):
    rewards = json.dumps(["correct", f"{__name__}:sums_taken"])
    overrides = run_overrides(tmp_path, warmup_cache, **{"rollout.max_new_tokens": 96, "rewards": rewards})
    trainer = Trainer(load_config(None, overrides))
    trainer.parts.producer.episodes.engine = ScriptedEngine(add_right_on_even_seeds)
    produced = trainer.parts.producer.produce(0)
    for batch in produced.generated:
        assert batch.reward_components["sums_taken"].tolist() == [1.0] * batch.num_rollouts
        for row, completion in enumerate(batch.completions):
            answer = batch.problems[int(batch.group_index[row])].answer
            right = f"<tool_response>{answer}</tool_response>" in completion
            assert float(batch.reward_components["correct"][row]) == float(right) == float(batch.correct[row])
    correct = [float(r) for b in produced.generated for r in b.reward_components["correct"]]
    assert 0 < sum(correct) < len(correct)  # both kinds of episode occurred
    assert produced.metrics["episode/tool_calls/add"] == len(correct)
    trainer.close_engines()


def add_right_for_even_a(context: str, seed: int) -> str:
    """Asks `add` for the prompt's sum where its first operand is even (one more where it is odd), then answers the
    right sum whatever the tool said: only the environment's reward tells the episodes apart."""
    a, b = map(int, re.match(r"(\d+)\+(\d+)=", context).groups())
    if "<tool_response>" in context:
        return str(a + b) + EOS_TEXT
    return call("add", a=a, b=b + a % 2)


def test_held_out_evaluation_runs_episodes_scored_by_their_environments(tmp_path, warmup_cache):
    overrides = run_overrides(tmp_path, warmup_cache, **{"rollout.max_new_tokens": 96, "task.eval_fraction": 0.25,
                                                          "eval.samples": 2})
    trainer = Trainer(load_config(None, overrides))
    held_out = [p.prompt for p in trainer.parts.eval_problems]
    assert len(held_out) == 3 and not set(held_out) & {p.prompt for p in trainer.parts.task.train_problems}
    trainer.parts.eval_episodes.engine = ScriptedEngine(add_right_for_even_a)
    metrics = trainer.run_eval()
    even = sum(int(p.split("+")[0]) % 2 == 0 for p in held_out) / len(held_out)
    assert 0 < even < 1  # both kinds of episode held out
    assert metrics["eval/accuracy"] == pytest.approx(even) == metrics["eval/avg@2"]  # every answer text is right
    assert metrics["eval/tool_calls"] == 1.0 and metrics["eval/turns"] == 2.0
    trainer.close_engines()


def test_an_environment_without_get_reward_is_refused_naming_the_field(tmp_path, warmup_cache):
    overrides = run_overrides(tmp_path, warmup_cache)
    overrides = [o.replace(":AdderEnv", ":NoReward") for o in overrides]
    with pytest.raises(ConfigError, match="task.args.environment: .*NoReward without a get_reward method"):
        Trainer(load_config(None, overrides))


def test_the_installed_trl_takes_environment_factories():
    pytest.importorskip("trl", reason="TRL is not installed (pip install 'podsrl[trl]'): the adapter's contract is "
                                      "not checked against it")
    from trl import GRPOTrainer

    assert "environment_factory" in inspect.signature(GRPOTrainer.__init__).parameters
