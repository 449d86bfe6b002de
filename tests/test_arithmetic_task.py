"""The built-in task: disjoint held-out/training sides drawn from the same distribution, fixed by seed."""

from collections import Counter

import pytest

from podsrl.errors import ConfigError
from podsrl.tasks.arithmetic import ArithmeticTask


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
                                       ({"operands": 1}, "operands"), ({"digits": 0}, "digits")])
def test_bad_arguments_name_the_key(args, key):
    with pytest.raises(ConfigError, match=f"task.args.{key}"):
        ArithmeticTask(**args)
