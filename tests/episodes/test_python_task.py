"""The built-in python task: its problems (sums and products) and their plain twin, reference episodes whose calls
run in the real sandbox and answer what the warm-up trains on, the reward, the warm-up key and its start, and bad
task arguments."""

from __future__ import annotations

import json

import pytest
import torch

from podsrl.batch import Problem
from podsrl.cli import main
from podsrl.config import EpisodeConfig, load_config
from podsrl.episodes.runner import EpisodeRunner
from podsrl.errors import ConfigError
from podsrl.run.warmup import plain_warmup_config, reference_rows, run_warmup, sft_batch, warmup_key
from podsrl.tasks import build_task
from podsrl.tasks.arithmetic import ArithmeticTask
from podsrl.tasks.arithmetic_python import ArithmeticPythonTask
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask
from tests.conftest import tiny_overrides
from tests.episodes.scripted import EOS_TEXT, TOKENIZER, ScriptedEngine
from tests.episodes.test_runner import PARAMS

PYTHON = {"task.name": "arithmetic_python", "task.args": "{operands: 2, digits: 1}",
          "model.tiny.max_position_embeddings": 160, "episode.max_tokens": 128, "episode.max_turns": 3}


def test_the_problems_are_sums_and_products_valued_with_precedence_and_the_plain_task_keeps_its_sums():
    task = ArithmeticPythonTask(seed=0, eval_size=40, operands=2)
    problems = [task.problem(i) for i in range(1000)]
    assert all(int(p.answer) == eval(p.prompt.removesuffix("=")) for p in problems)  # digits and + * alone
    assert {"+", "*"} <= {c for p in problems for c in p.prompt}
    assert 400 < sum("*" in p.prompt for p in problems) < 600
    assert [p.prompt for p in problems[:50]] == [ArithmeticTask(seed=0, eval_size=0, operators="+*", operands=2)
                                                 .problem(i).prompt for i in range(50)]  # the plain twin's problems
    held_out = {p.prompt for p in task.eval_set()}
    assert all(task.is_heldout(prompt) for prompt in held_out) and not held_out & {p.prompt for p in problems}
    # a small shape's held-out share is exact: 10 of its 100 prompts
    assert sum(task.is_heldout(f"{a}*{b}=") for a in range(10) for b in range(10)) == 10
    sums = ArithmeticTask(seed=1234, eval_size=3)  # operators "+" draws what it always drew
    assert [p.prompt for p in sums.eval_set()] == ["2+96=", "96+5=", "5+8+21="]
    assert [sums.problem(i).prompt for i in range(3)] == ["39+2=", "2+39=", "82+85+7="]


def reference_script(references: dict[str, str]):
    """The model's turn is the reference episode's turn for the context it reads."""
    return lambda context, seed: references[context] + EOS_TEXT


def test_the_reference_episodes_calls_run_in_the_sandbox_and_answer_what_the_warm_up_trains_on():
    task = ArithmeticPythonTask(seed=3, eval_size=0, tool_share=1.0)
    problems = [task.problem(i) for i in range(4)]
    turns = {p.uid: task.reference_turns(p) for p in problems}
    assert all(len(t) == 2 and '"code": "print(' in t[0][1] for t in turns.values())
    engine = ScriptedEngine(reference_script({c: turn for t in turns.values() for c, turn in t}))
    runner = EpisodeRunner(engine, TOKENIZER, task, EpisodeConfig(max_turns=3, max_tokens=128))
    out = runner.run(problems, [1] * len(problems), PARAMS, torch.arange(len(problems)))
    # the second turn reads exactly the reference's context: the call, and what the sandbox printed
    assert engine.calls[1]["contexts"] == [turns[p.uid][1][0] for p in problems]
    gen = out.generation
    for row, p in enumerate(problems):
        text = TOKENIZER.decode(gen.completion_ids[row, :int(gen.completion_mask[row].sum())], skip_special_tokens=True)
        assert text == turns[p.uid][1][0].removeprefix(p.prompt) + p.answer and task.is_correct(text, p)
    metrics = out.stats.metrics()
    assert metrics["episode/tool_calls/python"] == len(problems) and metrics["episode/tool_faults"] == 0.0
    assert all(env.tool_results[0].content == p.answer + "\n" for env, p in zip(out.environments, problems))


def test_a_failing_program_is_answered_and_counted_and_the_reward_reads_the_text_after_the_last_response():
    task = ArithmeticPythonTask(seed=0, eval_size=0)
    problem = Problem(uid="p", prompt="12*37+5=", answer="449")
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(12*37+5/0)"}}</tool_call>'
    engine = ScriptedEngine(lambda context, seed: ("449" if "</tool_response>" in context else call) + EOS_TEXT)
    out = EpisodeRunner(engine, TOKENIZER, task, EpisodeConfig(max_turns=3, max_tokens=128)).run(
        [problem], [1], PARAMS, torch.tensor([0]))
    assert out.stats.metrics()["episode/tool_faults/python"] == 1.0
    assert "ZeroDivisionError" in out.environments[0].tool_results[0].content
    response = "<tool_response>449\n</tool_response>"
    assert task.is_correct(call + response + "449", problem) and task.is_correct(" 449 ", problem)
    assert not task.is_correct(call + response, problem)  # the tool printed it; the model did not answer
    assert not task.is_correct("449" + call + "<tool_response>12\n</tool_response>450", problem)
    assert task.score_batch([call + response + "449", "450"], [problem] * 2) == [1.0, 0.0]


def test_the_warm_up_rows_train_the_call_and_the_answer_not_the_programs_output():
    task = ArithmeticPythonTask(seed=0, eval_size=0, tool_share=0.5, operands=2)
    problems = [task.problem(i) for i in range(400)]
    calls = sum(len(task.reference_turns(p)) == 2 for p in problems)
    assert 0.4 < calls / len(problems) < 0.6
    problem = next(p for p in problems if len(task.reference_turns(p)) == 2)
    ids, _, labels = sft_batch(TOKENIZER, *reference_rows(task, [problem]))
    trained = [TOKENIZER.decode(ids[r][labels[r] != -100]) for r in range(len(ids))]
    (_, call), (context, answer) = task.reference_turns(problem)
    assert trained == [call + EOS_TEXT, answer + EOS_TEXT] and "<tool_response>" in context
    assert TOKENIZER.decode(TOKENIZER(context, add_special_tokens=False).input_ids) == context  # all in the vocabulary
    at_once = ArithmeticPythonTask(seed=0, eval_size=0, tool_share=0.0, operands=2)
    assert all(at_once.reference_turns(p) == [(p.prompt, p.answer)] for p in problems[:50])


def test_the_warm_up_key_follows_the_episode_settings_and_starts_from_the_plain_twin(tmp_path):
    def cfg(*overrides, **extra):
        return load_config(None, tiny_overrides(tmp_path, str(tmp_path), **{**PYTHON, **extra}) + list(overrides))

    base = warmup_key(cfg())
    assert warmup_key(cfg(**{"task.args": "{operands: 2, digits: 1, tool_share: 0.3}"})) != base
    assert warmup_key(cfg("episode.max_turns=2")) != base and warmup_key(cfg("warmup.episode_steps=7")) != base
    start = plain_warmup_config(cfg(**{"task.args": "{operands: 2, digits: 1, tool_share: 0.3}"}))
    assert start.task.name == "arithmetic" and start.task.args == {"operators": "+*", "operands": 2, "digits": 1}
    # the presets: the python run's warm-up starts from its baseline's, and the calculator's is still the shipped one
    python, plain = load_config("podsrl/configs/arithmetic_python.yaml"), \
        load_config("podsrl/configs/arithmetic_python_plain.yaml")
    assert warmup_key(plain_warmup_config(python)) == warmup_key(plain)
    assert warmup_key(plain_warmup_config(load_config("podsrl/configs/arithmetic_tool.yaml"))) == "bab1324d61aea602"


def test_the_episode_warm_up_continues_the_plain_one_and_reports_its_calls(tmp_path, warmup_cache):
    cfg = load_config(None, tiny_overrides(tmp_path, warmup_cache, **PYTHON, **{"warmup.episode_steps": 3,
                                                                                "warmup.validation_size": 4}))
    info = json.loads((run_warmup(cfg, progress=False) / "warmup.json").read_text())
    assert info["steps"] == 3 and {"validation_tool_calls", "validation_tool_faults"} <= set(info)
    assert (run_warmup(plain_warmup_config(cfg), progress=False) / "config.json").is_file()  # cached on its key


@pytest.mark.parametrize("args, field", [
    ({"tool_share": 1.5}, "task.args.tool_share"), ({"tool_share": True}, "task.args.tool_share"),
    ({"operators": "+/"}, "task.args.operators"), ({"operators": ""}, "task.args.operators"),
    ({"operators": "++"}, "task.args.operators"), ({"operators": 3}, "task.args.operators")])
def test_bad_arguments_are_refused_naming_the_field(args, field):
    with pytest.raises(ConfigError, match=field):
        ArithmeticPythonTask(seed=0, eval_size=0, **args)


def test_tasks_whose_references_are_sums_refuse_other_operators(tmp_path, capsys):
    with pytest.raises(ConfigError, match="task.args.operators"):
        ArithmeticToolTask(seed=0, eval_size=0, operators="+*")
    with pytest.raises(ConfigError, match="task.args.solution"):
        ArithmeticTask(seed=0, eval_size=0, operators="+*", solution="worked")
    assert build_task(load_config(None, ["task.name=arithmetic_python"]).task).operators == "+*"
    code = main(["train", "--config", "arithmetic_python", *tiny_overrides(tmp_path, str(tmp_path), **{**PYTHON, "task.args": "{operators: '+%'}"})])
    assert code == 2 and "task.args.operators" in capsys.readouterr().err
