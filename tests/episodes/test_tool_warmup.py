"""The episode task's warm-up and evaluation: reference episodes call the calculator on a sub-sum in a share of
problems, their tool answers get no loss, the warm-up key follows what shapes it, the warm-up starts from the plain
task's, and held-out evaluation runs episodes (the model's calls are answered), counting calls and faults."""

from __future__ import annotations

import json

import pytest
import torch

from podsrl.config import EpisodeConfig, load_config
from podsrl.episodes.environment import ToolEnvironment
from podsrl.episodes.render import RESPONSE_START
from podsrl.episodes.runner import EpisodeRunner
from podsrl.errors import ConfigError
from podsrl.models.loading import build_char_tokenizer
from podsrl.run.evaluation import evaluate
from podsrl.run.warmup import plain_warmup_config, reference_rows, run_warmup, sft_batch, warmup_key
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask, calculator
from tests.conftest import device_under_test, tiny_overrides
from tests.episodes.scripted import EOS_TEXT, TOKENIZER, ScriptedEngine
from tests.episodes.test_runner import calculator_script

TOOL = {"task.name": "arithmetic_tool", "model.tiny.max_position_embeddings": 160, "episode.max_tokens": 128,
        "episode.max_turns": 3}


def test_a_share_of_reference_episodes_call_the_calculator_on_a_sub_sum_and_then_answer():
    task = ArithmeticToolTask(seed=0, eval_size=0, tool_share=0.5)
    problems = [task.problem(i) for i in range(400)]
    calls = 0
    for problem in problems:
        turns = task.reference_turns(problem)
        assert turns[0][0] == problem.prompt and turns[-1][1] == problem.answer
        if len(turns) == 1:
            continue
        calls += 1
        (_, call), (context, _) = turns
        env = ToolEnvironment([calculator], 1.0)
        env.reset(problem)
        messages, done = env.step(call)  # the call is well formed and the calculator answers it
        assert not done and not env.tool_results[0].fault
        expression = json.loads(call.removeprefix("<tool_call>").removesuffix("</tool_call>"))["arguments"]
        operands = problem.prompt.rstrip("=").split("+")
        assert expression["expression"] in {"+".join(operands[:k]) for k in range(2, len(operands) + 1)}
        assert context == problem.prompt + call + f"<tool_response>{messages[0]['content']}</tool_response>"
        assert task.is_correct(context.removeprefix(problem.prompt) + problem.answer, problem)
    assert 0.4 < calls / len(problems) < 0.6
    assert all(len(ArithmeticToolTask(seed=0, eval_size=0, tool_share=0.0).reference_turns(p)) == 1
               for p in problems[:50])


def test_tool_share_outside_0_1_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="task.args.tool_share"):
        ArithmeticToolTask(seed=0, eval_size=0, tool_share=1.5)


def test_the_tool_answer_gets_no_loss_in_the_warm_up_rows():
    task = ArithmeticToolTask(seed=0, eval_size=0, tool_share=1.0)
    tokenizer = build_char_tokenizer()
    problem = task.problem(3)
    ids, _, labels = sft_batch(tokenizer, *reference_rows(task, [problem]))
    trained = [tokenizer.decode(ids[r][labels[r] != -100]) for r in range(len(ids))]
    (_, call), (context, answer) = task.reference_turns(problem)
    assert trained == [call + EOS_TEXT, answer + EOS_TEXT]  # each model turn, ended; prompts and answers not
    assert RESPONSE_START in context and all(RESPONSE_START not in t for t in trained)


def test_the_warm_up_key_follows_the_episode_settings_and_the_plain_key_does_not(tmp_path):
    def key(*overrides):
        return warmup_key(load_config(None, tiny_overrides(tmp_path, str(tmp_path), **TOOL) + list(overrides)))

    base = key()
    assert key("task.args={operands: 2, digits: 1, tool_share: 0.3}") != base
    assert key("episode.max_turns=2") != base and key("warmup.episode_steps=7") != base
    plain = load_config(None, tiny_overrides(tmp_path, str(tmp_path)))
    assert warmup_key(plain) == warmup_key(load_config(None, tiny_overrides(tmp_path, str(tmp_path),
                                                                            **{"warmup.episode_steps": 7})))
    tool = load_config(None, tiny_overrides(tmp_path, str(tmp_path), **TOOL,
                                            **{"task.args": "{operands: 2, digits: 1, tool_share: 0.3}"}))
    start = plain_warmup_config(tool)
    assert start.task.name == "arithmetic" and start.task.args == {"operands": 2, "digits": 1}


def test_the_episode_warm_up_continues_the_plain_one_and_reports_its_calls(tmp_path, warmup_cache):
    overrides = tiny_overrides(tmp_path, warmup_cache, **TOOL, **{"warmup.episode_steps": 3,
                                                                  "warmup.validation_size": 8})
    cfg = load_config(None, overrides)
    path = run_warmup(cfg, progress=False)
    info = json.loads((path / "warmup.json").read_text())
    assert info["steps"] == 3 and {"validation_tool_calls", "validation_tool_faults"} <= set(info)
    assert (run_warmup(plain_warmup_config(cfg), progress=False) / "config.json").is_file()  # cached on its key


def answers_with_the_calculator(context: str, seed: int) -> str:
    """The calculator script, its call ending the turn with EOS as the warmed-up model's does."""
    text = calculator_script(context, seed)
    return text.removesuffix(" and more text") + EOS_TEXT


def test_evaluation_runs_episodes_where_the_task_has_an_environment():
    task = ArithmeticToolTask(seed=0, eval_size=6, operands=2, digits=1)
    problems = task.eval_set()
    engine = ScriptedEngine(answers_with_the_calculator)

    def verify(problems_, group_index, texts, environments=None):
        return torch.tensor([task.is_correct(t, problems_[g]) for t, g in zip(texts, group_index.tolist())])

    runner = EpisodeRunner(engine, TOKENIZER, task, EpisodeConfig(max_turns=3, max_tokens=128))
    metrics = evaluate(engine, TOKENIZER, problems, verify, 96, samples=2, episodes=runner)
    assert metrics["eval/accuracy"] == 1.0 and metrics["eval/avg@2"] == 1.0
    assert metrics["eval/tool_calls"] == 1.0 and metrics["eval/tool_faults"] == 0.0 and metrics["eval/turns"] == 2.0
    single_turn = evaluate(engine, TOKENIZER, problems, verify, 96)  # the call unanswered: no answer at all
    assert single_turn["eval/accuracy"] == 0.0 and "eval/tool_calls" not in single_turn


def test_the_trainer_evaluates_an_episode_task_on_episodes(tmp_path, warmup_cache):
    from podsrl.run.trainer import Trainer

    overrides = tiny_overrides(tmp_path, warmup_cache, **TOOL, **{"warmup.episode_steps": 3,
                                                                  "warmup.validation_size": 8,
                                                                  "rollout.max_new_tokens": 16})
    trainer = Trainer(load_config(None, overrides))
    try:
        episodes = trainer.parts.eval_episodes
        assert episodes is not None and episodes.engine is trainer.parts.eval_engine
        metrics = trainer.run_eval()
        assert {"eval/accuracy", "eval/tool_calls", "eval/tool_faults", "eval/turns"} <= set(metrics)
        assert trainer.parts.model.device.type == device_under_test().type
    finally:
        trainer.close_engines()
