import logging
import sys

import pytest
import torch

from podsrl.errors import ConfigError, UserError
from podsrl.rewards import TaskVerifierReward, build_reward_manager
from podsrl.tasks.reasoning_gym import ReasoningGymTask, extract_completion_answer


@pytest.fixture(scope="module")
def task():
    pytest.importorskip("reasoning_gym")
    return ReasoningGymTask("chain_sum", size=50, seed=7, eval_size=20, min_terms=2, max_terms=3)


def test_problems_are_chain_sums(task):
    p = task.problem(0)
    expression = p.metadata["expression"]
    assert p.prompt.endswith(f"{expression} =")
    assert p.answer == str(eval(expression))  # the gold is the actual sum (only +/- and integers here)
    assert p.metadata["source_dataset"] == "chain_sum" and 2 <= p.metadata["num_terms"] <= 3


def test_verify_correct_and_wrong(task):
    p = task.problem(3)
    gold = int(p.answer)
    assert task.is_correct(f"<think>\nadding\n</think>\n<answer>{gold}</answer>", p)
    assert task.score(f"some work\n{gold}", p) == 1.0  # last line when there is no answer block
    assert not task.is_correct(f"<answer>{gold + 1}</answer>", p)
    assert not task.is_correct(f"<answer>{gold}</answer> then <answer>{gold + 1}</answer>", p)  # last block
    assert task.score("", p) == 0.0


def test_correct_reward_uses_score_answer(task):
    m = build_reward_manager(["correct"], task)
    assert isinstance(m.specs[0].fn, TaskVerifierReward)
    problems = [task.problem(i) for i in range(2)]
    comps = [f"<answer>{problems[0].answer}</answer>", "<answer>x</answer>", f"<answer>{problems[1].answer}</answer>"]
    r = m.score(problems, torch.tensor([0, 0, 1]), comps)
    assert r.correct.tolist() == [True, False, True] and r.rewards.tolist() == [1.0, 0.0, 1.0]


def test_order_and_eval_split(task):
    uids = [task.problem(i).uid for i in range(50)]
    assert len(set(uids)) == 50  # one epoch visits every problem once
    assert [task.problem(i).uid for i in range(50, 100)] != uids
    again = ReasoningGymTask("chain_sum", size=50, seed=7, eval_size=20, min_terms=2, max_terms=3)
    assert [again.problem(i).prompt for i in range(60)] == [task.problem(i).prompt for i in range(60)]
    ev = task.eval_set()
    assert 0 < len(ev) <= 20 and ev == task.eval_set()
    train_prompts = {task.problem(i).prompt for i in range(50)}
    assert not train_prompts & {p.prompt for p in ev}


def test_extract_completion_answer():
    assert extract_completion_answer("<answer> 12 </answer>") == "12"
    assert extract_completion_answer("a\n\n b = 5 \n\n") == "b = 5"
    assert extract_completion_answer("") == ""


def test_partial_credit_warns_once(task, caplog, monkeypatch):
    monkeypatch.setattr(task, "partial_credit_seen", False)
    monkeypatch.setattr(task._train, "score_answer", lambda answer, entry: 0.3 if answer == "close" else 1.0)
    p = task.problem(0)
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        assert task.score("<answer>close</answer>", p) == pytest.approx(0.3)
        assert not task.is_correct("<answer>close</answer>", p)
        task.score("<answer>close</answer>", p)
    warnings = [r for r in caplog.records if "partial credit" in r.getMessage()]
    assert len(warnings) == 1 and "0.3" in warnings[0].getMessage()


def test_config_errors():
    pytest.importorskip("reasoning_gym")
    with pytest.raises(ConfigError, match="unknown reasoning-gym dataset 'no_such_gym'"):
        ReasoningGymTask("no_such_gym", size=5)
    with pytest.raises(ConfigError, match="task.params .*bogus"):
        ReasoningGymTask("chain_sum", size=5, bogus=1)
    with pytest.raises(ConfigError, match="max_terms"):
        ReasoningGymTask("chain_sum", size=5, min_terms=5, max_terms=2)


def test_missing_reasoning_gym_names_its_own_extra(monkeypatch):
    """reasoning-gym is not in `tasks` (its pycosat compiles at install): the refusal names the extra that has it."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(UserError) as refused:
        ReasoningGymTask("chain_sum", size=10)
    assert str(refused.value) == (
        "the reasoning_gym task 'chain_sum' needs the optional package 'reasoning-gym', which is not installed: "
        "pip install 'podsrl[reasoning-gym]' (or pip install reasoning-gym); reasoning-gym has an extra of its own "
        "because its dependency pycosat publishes no Linux wheel and is compiled at install (a C compiler is needed)")
