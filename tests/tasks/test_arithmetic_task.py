"""The built-in task: disjoint held-out/training sides drawn from the same distribution, fixed by seed; plain or
worked-solution completions."""

import json
from collections import Counter

import pytest

from podsrl.batch import Problem
from podsrl.config import load_config
from podsrl.errors import ConfigError
from podsrl.models.loading import build_char_tokenizer
from podsrl.run.warmup import run_warmup, validation_tokens, warmup_key
from podsrl.tasks import build_task
from podsrl.tasks.arithmetic import ArithmeticTask, worked_solution
from tests.conftest import device_under_test


def shape(prompt: str) -> str:
    return "".join(str(len(x)) for x in prompt.rstrip("=").split("+"))


@pytest.fixture(scope="module")
def task():
    return ArithmeticTask(seed=7, eval_size=2000)


def test_heldout_prompts_never_appear_in_training(task):
    heldout = {p.prompt for p in task.eval_set()}
    assert all(task.problem(i).prompt not in heldout for i in range(20000))
    assert all(task.is_heldout(p) for p in heldout)


def test_both_sides_have_the_same_mix_of_problem_shapes(task):
    # Two-sample chi-square over the 12 shapes (11 degrees of freedom; 0.1% critical value 31.3).
    ev = Counter(shape(p.prompt) for p in task.eval_set())
    tr = Counter(shape(task.problem(i).prompt) for i in range(20000))
    n_ev, n_tr = sum(ev.values()), sum(tr.values())
    chi2 = 0.0
    for s in set(ev) | set(tr):
        total = ev[s] + tr[s]
        for observed, n in ((ev[s], n_ev), (tr[s], n_tr)):
            expected = total * n / (n_ev + n_tr)
            chi2 += (observed - expected) ** 2 / expected
    assert len(ev) == 12 and chi2 < 31.3, (chi2, ev, tr)


def test_small_shapes_hold_out_an_exact_share(task):
    one_digit_pairs = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    assert sum(task.is_heldout(p) for p in one_digit_pairs) == 10
    two_by_one = [f"{a}+{b}=" for a in range(10, 100) for b in range(10)]
    assert sum(task.is_heldout(p) for p in two_by_one) == 90


def test_problems_are_a_function_of_seed_and_index(task):
    again = ArithmeticTask(seed=7, eval_size=2000)
    assert [p.prompt for p in again.eval_set()] == [p.prompt for p in task.eval_set()]
    assert [again.problem(i) for i in range(50)] == [task.problem(i) for i in range(50)]
    other = ArithmeticTask(seed=8, eval_size=2000)
    assert [p.prompt for p in other.eval_set()] != [p.prompt for p in task.eval_set()]
    assert all(str(eval(p.prompt[:-1])) == p.answer for p in task.eval_set()[:200])


@pytest.mark.parametrize("args, key", [({"holdout_fraction": 0.0}, "holdout_fraction"),
                                       ({"holdout_fraction": 1.5}, "holdout_fraction"),
                                       ({"operands": 1}, "operands"), ({"digits": 0}, "digits"),
                                       ({"solution": "steps"}, "solution")])
def test_bad_arguments_name_the_key(args, key):
    with pytest.raises(ConfigError, match=f"task.args.{key}"):
        ArithmeticTask(**args)


SUM = Problem(uid="x", prompt="47+8+93=", answer="148")


def test_worked_solutions_are_running_sums_then_the_answer():
    task = ArithmeticTask(eval_size=10, solution="worked")
    assert task.reference_completion(SUM) == "47+8=55,55+93=148;148"
    assert task.reference_completion(Problem(uid="y", prompt="5+7=", answer="12")) == "5+7=12;12"
    assert worked_solution([9, 99, 99, 9]) == "9+99=108,108+99=207,207+9=216;216"
    assert all(task.is_correct(task.reference_completion(p), p) for p in task.eval_set())


@pytest.mark.parametrize("completion, right", [
    ("47+8=55,55+93=148;148", True),
    (" 47+8=55,55+93=148; 148 \n", True),
    ("47+8=56,56+93=149;148", True),  # only the answer is checked, not the working
    ("x;1;148", True),  # the last marker counts
    ("47+8=55,55+93=148;149", False),
    ("47+8=55,55+93=148;1480", False),
    ("47+8=55,55+93=148;", False),
    ("148;47", False),
    ("148", False),  # an answer must follow the marker
    ("", False),
])
def test_worked_reward_checks_the_answer_after_the_marker(completion, right):
    assert ArithmeticTask(eval_size=10, solution="worked").is_correct(completion, SUM) is right


def test_the_default_is_the_plain_answer():
    plain, worked = build_task(load_config(None, ["task.eval_size=50"]).task), ArithmeticTask(eval_size=50,
                                                                                              solution="worked")
    assert plain.solution == "answer" and plain.reference_completion(SUM) == "148"
    assert plain.is_correct(" 148\n", SUM) and not plain.is_correct("47+8=55,55+93=148;148", SUM)
    # the same problems either way: only the completion format differs
    assert [p.prompt for p in plain.eval_set()] == [p.prompt for p in worked.eval_set()]
    assert [plain.problem(i) for i in range(50)] == [worked.problem(i) for i in range(50)]
    tokenizer = build_char_tokenizer()
    assert validation_tokens(tokenizer, plain, plain.eval_set()) == 8  # the warm-up's validation as before
    assert validation_tokens(tokenizer, worked, worked.eval_set()) == 1 + max(
        len(worked.reference_completion(p)) for p in worked.eval_set())
    assert "solution" not in load_config(None, []).task.args  # so the default warm-up keeps its cache key
    assert warmup_key(load_config(None, [])) != warmup_key(load_config(None, ["task.args={solution: worked}"]))


def test_a_worked_warmup_runs_on_the_configured_device(tmp_path):
    overrides = [f"warmup.cache_dir={tmp_path}", "warmup.steps=4", "warmup.check_every=2", "warmup.batch_size=8",
                 "warmup.validation_size=8", "model.tiny.num_layers=1", "model.tiny.hidden_size=32",
                 "model.tiny.intermediate_size=64", "task.args={solution: worked, operands: 3}", "task.eval_size=8"]
    cfg = load_config(None, [*overrides, f"model.device={device_under_test().type}"])
    out = run_warmup(cfg, progress=False)
    assert json.loads((out / "warmup.json").read_text())["steps"] == 4
    # the device is not part of the cache key: a warm-up made on one machine serves runs on another
    assert out.name == warmup_key(load_config(None, [*overrides, "model.device=cuda"]))
