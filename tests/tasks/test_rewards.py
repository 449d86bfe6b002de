import math
import time

import pytest
import torch

from podsrl.answers import answer_region
from podsrl.batch import Problem
from podsrl.errors import ConfigError, UserError
from podsrl.math_verify_pool import CRASHED, TIMEOUT, MathVerifyPool, ProcessPool
from podsrl.rewards import (
    MathVerifyReward,
    RewardManager,
    RewardSpec,
    TaskVerifierReward,
    build_reward_manager,
    format_reward,
    load_function,
    tag_count_reward,
)
from podsrl.tasks.base import Task
from tests.fixtures_tasks import reward_helpers


class ListTask(Task):
    """A task without its own verifier (like a dataset task): `correct` falls back to math-verify."""

    name = "list"

    def __init__(self, problems):
        self.problems = problems

    def problem(self, index):
        return self.problems[index % len(self.problems)]

    def eval_set(self):
        return list(self.problems)


class ExactTask(ListTask):
    """A task with its own verifier: exact string match of the stripped completion."""

    def is_correct(self, completion, problem):
        return completion.strip() == problem.answer


class PartialTask(ListTask):
    """A task giving partial credit: the completion is the score."""

    def score(self, completion, problem):
        return float(completion)


PROBLEMS = [
    Problem("u0", "p0", "1/2", {"level": 1}),
    Problem("u1", "p1", "3", {"level": 2}),
]
GROUP = torch.tensor([0, 0, 1, 1, 1])
COMPLETIONS = ["0.5", "1", "3.0", "\\boxed{3}", "4"]


@pytest.fixture(scope="module")
def pool():
    p = MathVerifyPool(workers=2, item_timeout_s=5.0)
    yield p
    p.close()


# ---------------------------------------------------------------- math-verify

MV_CASES = [
    ("1/2", "0.5", True),
    ("1/2", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", "The answer is $0.5$", True),
    ("0.5", "so $\\boxed{\\frac12}$", True),
    ("3", "3.0", True),
    ("3", "the result is \\boxed{3}", True),
    ("72", "<think>\n70+2\n</think>\n<answer>\n72\n</answer>", True),
    ("1000", "1,000", True),
    ("72", "73", False),
    ("1/2", "0.25", False),
    ("12", "<answer>13</answer> although 12 was mentioned", False),  # the answer block decides
    ("1/2", "<answer>\\dfrac{1}{2}</answer>", True),  # bare LaTeX in the answer block
    ("5", "junk without numbers", False),
    ("5", "", False),
    ("5", "}}}{{{\\frac{\\boxed{", False),
]


def test_math_verify_table(pool):
    golds, preds, want = zip(*MV_CASES)
    assert pool.check(list(golds), list(preds)) == list(want)


def test_math_verify_long_input_capped(pool):
    long = "blah 17 " * 200_000 + "so the final answer is \\boxed{42}"
    assert pool.check(["42"], [long]) == [True]  # True, not None: finished inside the per-item timeout
    assert answer_region(long, 2000) == "\\boxed{42}"
    assert answer_region("blah 17 " * 1000, 2000) == ("blah 17 " * 1000)[-2000:]


@pytest.mark.parametrize("completion,region", [
    ("<answer>1</answer> \\boxed{2} <answer> 3 </answer> tail", " 3 "),      # the last answer block
    ("<answer>1</answer> then <answer> </answer>", "<answer>1</answer> then <answer> </answer>"),  # empty: next rules
    ("x \\boxed{1} y \\boxed{\\frac{a}{b}} z", "\\boxed{\\frac{a}{b}}"),   # else the last \\boxed{}, braces matched
    ("so \\fbox{7}.", "\\fbox{7}"),
    ("\\boxed{unclosed", "\\boxed{unclosed"),                               # else the text itself
    ("<answer>4", "4"),                                                    # an unclosed last block runs to the end
])
def test_answer_region_order(completion, region):
    assert answer_region(completion) == region


def test_process_pool_kills_hung_worker_and_keeps_order():
    with ProcessPool(reward_helpers.sleep_then_echo, workers=2, item_timeout_s=1.0) as pp:
        out = pp.map([0.0, 30.0, 0.1, 0.0])
        assert out == [("ok", 0.0), (TIMEOUT, None), ("ok", 0.1), ("ok", 0.0)]
        assert pp.restarts == 1
        assert pp.map([0.0, 0.0, 0.0]) == [("ok", 0.0)] * 3  # the replacement worker serves again


def test_process_pool_survives_crashed_worker():
    with ProcessPool(reward_helpers.crash_if_negative, workers=1, item_timeout_s=5.0) as pp:
        assert pp.map([1.0, -1.0, 2.0]) == [("ok", 1.0), (CRASHED, None), ("ok", 2.0)]


# ---------------------------------------------------------------- built-ins


def test_format_and_tag_count():
    good = "<think>\nreason\n</think>\n<answer>\n4\n</answer>\n"
    one_line = " <think> r </think> <answer>4</answer>"  # whitespace around the tags is free
    broken = ["4", "<answer>4</answer>", "<think>r</think><answer>4</answer> and more",
              "<think>r</think><answer>4</answer><answer>5</answer>", "<think>a<think>b</think><answer>4</answer>",
              "<answer>4</answer><think>r</think>"]
    assert format_reward([], [good, one_line, *broken]) == [1.0, 1.0] + [0.0] * len(broken)
    assert tag_count_reward([], [good, one_line, "<think>\nx\n</think>\n", "<think>\n<think>\n", ""]) == \
        [1.0, 1.0, 0.5, 0.0, 0.0]


def test_correct_uses_task_verifier_when_present(pool):
    # gold "1/2", completion "0.5": the exact-match task says wrong, math-verify says right
    exact = build_reward_manager(["correct"], ExactTask(PROBLEMS), pool=pool)
    mv = build_reward_manager(["correct"], ListTask(PROBLEMS), pool=pool)
    assert isinstance(exact.specs[0].fn, TaskVerifierReward) and isinstance(mv.specs[0].fn, MathVerifyReward)
    assert ExactTask(PROBLEMS).has_verifier() and not ListTask(PROBLEMS).has_verifier()
    r_exact = exact.score(PROBLEMS, GROUP, COMPLETIONS)
    r_mv = mv.score(PROBLEMS, GROUP, COMPLETIONS)
    assert r_exact.correct.tolist() == [False, False, False, False, False]
    assert r_mv.correct.tolist() == [True, False, True, True, False]
    assert r_mv.rewards.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    r = exact.score(PROBLEMS, GROUP, ["1/2", "x", "3", "3 ", "4"])
    assert r.correct.tolist() == [True, False, True, True, False]


def test_partial_credit_threshold():
    m = build_reward_manager(["correct"], PartialTask(PROBLEMS))
    r = m.score(PROBLEMS, GROUP, ["0.5", "0.49", "1", "0", "0.75"])
    assert r.correct.tolist() == [True, False, True, False, True]
    assert r.components["correct"].tolist() == pytest.approx([0.5, 0.49, 1.0, 0.0, 0.75])


def test_weighted_sum_metrics_and_columns():
    seen = {}

    def spy(prompts, completions, **cols):
        seen.update(cols, prompts=prompts)
        return [float(lv) for lv in cols["level"]]

    m = RewardManager([RewardSpec("correct", 1.0, TaskVerifierReward(ExactTask(PROBLEMS))),
                       RewardSpec("spy", 0.5, spy)], ExactTask(PROBLEMS))
    r = m.score(PROBLEMS, GROUP, ["1/2", "no", "3", "no", "no"])
    assert seen["prompts"] == ["p0", "p0", "p1", "p1", "p1"]
    assert seen["answer"] == ["1/2", "1/2", "3", "3", "3"]
    assert seen["problem_uid"] == ["u0", "u0", "u1", "u1", "u1"]
    assert seen["level"] == [1, 1, 2, 2, 2]
    assert r.rewards.tolist() == [1.5, 0.5, 2.0, 1.0, 1.0]
    assert r.valid.all() and r.has_correct
    assert r.metrics["rewards/correct/mean"] == pytest.approx(0.4)
    assert r.metrics["rewards/spy/mean"] == pytest.approx(1.6)
    assert r.metrics["rewards/spy/std"] == pytest.approx(torch.tensor([1.0, 1, 2, 2, 2]).std().item())
    assert r.metrics["rewards/spy/errors"] == 0 and r.metrics["rewards/spy/invalid"] == 0


def test_no_correct_reward_means_all_false():
    m = build_reward_manager(["format"], ListTask(PROBLEMS))
    r = m.score(PROBLEMS, GROUP, COMPLETIONS)
    assert not r.has_correct and not r.correct.any()


# ---------------------------------------------------------------- fault policies


def raising(prompts, completions, **cols):
    raise ValueError("boom")


def hanging(prompts, completions, **cols):
    time.sleep(2.5)
    return [1.0] * len(completions)


def nan_at_1(prompts, completions, **cols):
    return [1.0, float("nan"), 0.5, 0.25, 1.0]


def none_at_3(prompts, completions, **cols):
    return [1.0, 1.0, 0.5, None, 1.0]


def string_at_2(prompts, completions, **cols):
    return [1.0, 1.0, "0.5", 1.0, float("inf")]


def short(prompts, completions, **cols):
    return [1.0] * (len(completions) - 1)


def scalar(prompts, completions, **cols):
    return 1.0


def manager(fn, policy, timeout_s=1.0):
    return RewardManager([RewardSpec("bad", 1.0, fn), RewardSpec("format", 1.0, format_reward)],
                         ListTask(PROBLEMS), on_error=policy, timeout_s=timeout_s)


WHOLE_CALL = [(raising, "errors"), (hanging, "timeouts"), (short, "invalid"), (scalar, "invalid")]
PER_ROW = [(nan_at_1, [1], [1.0, 0.0, 0.5, 0.25, 1.0]), (none_at_3, [3], [1.0, 1.0, 0.5, 0.0, 1.0]),
           (string_at_2, [2, 4], [1.0, 1.0, 0.0, 1.0, 0.0])]


@pytest.mark.parametrize("fn,kind", WHOLE_CALL)
def test_whole_call_faults(fn, kind):
    r = manager(fn, "zero").score(PROBLEMS, GROUP, COMPLETIONS)
    assert r.components["bad"].tolist() == [0.0] * 5 and r.valid.all()
    assert r.metrics[f"rewards/bad/{kind}"] == 5
    assert r.metrics["rewards/format/errors"] == 0
    r = manager(fn, "skip").score(PROBLEMS, GROUP, COMPLETIONS)
    assert not r.valid.any() and r.rewards.isnan().all() and r.components["bad"].isnan().all()
    assert r.components["format"].tolist() == [0.0] * 5  # other functions still scored
    with pytest.raises(UserError, match="'bad'.*uid='u0'"):
        manager(fn, "fail").score(PROBLEMS, GROUP, COMPLETIONS)


@pytest.mark.parametrize("fn,rows,zeroed", PER_ROW)
def test_per_row_faults(fn, rows, zeroed):
    r = manager(fn, "zero").score(PROBLEMS, GROUP, COMPLETIONS)
    assert r.components["bad"].tolist() == zeroed and r.valid.all()
    assert r.metrics["rewards/bad/invalid"] == len(rows)
    r = manager(fn, "skip").score(PROBLEMS, GROUP, COMPLETIONS)
    assert [i for i in range(5) if not r.valid[i]] == rows
    assert all(math.isnan(r.rewards[i]) == (i in rows) for i in range(5))
    assert r.metrics["rewards/invalid_rollouts"] == len(rows)
    uid = PROBLEMS[int(GROUP[rows[0]])].uid
    with pytest.raises(UserError, match=f"'bad'.*uid='{uid}'.*rollout {rows[0]}"):
        manager(fn, "fail").score(PROBLEMS, GROUP, COMPLETIONS)


def test_math_verify_timeout_counts_as_timeout():
    class Slow(MathVerifyReward):
        def score_detailed(self, prompts, completions, **cols):
            return [1.0, None, 0.0, 0.0, 1.0], [False, True, False, False, False]

    m = RewardManager([RewardSpec("correct", 1.0, Slow())], ListTask(PROBLEMS), on_error="skip")
    r = m.score(PROBLEMS, GROUP, COMPLETIONS)
    assert r.metrics["rewards/correct/timeouts"] == 1 and r.valid.tolist() == [True, False, True, True, True]
    assert r.correct.tolist() == [True, False, False, False, True]


# ---------------------------------------------------------------- config


def test_custom_reward_by_import_path_and_file(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def shout(prompts, completions, **cols):\n    return [float(c.isupper()) for c in completions]\n")
    m = build_reward_manager(
        ["tests.fixtures_tasks.reward_helpers:length_reward",
         {"name": "loud", "weight": 2.0, "function": f"{f}:shout"}],
        ListTask(PROBLEMS),
    )
    assert [s.name for s in m.specs] == ["length_reward", "loud"]
    r = m.score(PROBLEMS, GROUP, ["abcd", "AB", "x", "Y", ""])
    assert r.components["length_reward"].tolist() == pytest.approx([0.4, 0.2, 0.1, 0.1, 0.0])
    assert r.rewards.tolist() == pytest.approx([0.4, 2.2, 0.1, 2.1, 0.0])


def test_default_rewards_from_task(pool):
    m = build_reward_manager(None, ListTask(PROBLEMS), pool=pool)
    assert [s.name for s in m.specs] == ["correct"]


@pytest.mark.parametrize(
    "entries,match",
    [
        (["correct", "nope"], r"rewards\[1\]\.name: unknown reward 'nope'"),
        ([{"name": "format", "weight": "x"}], r"rewards\[0\]\.weight"),
        ([{"name": "format", "wieght": 1}], r"rewards\[0\]: unknown keys \['wieght'\]"),
        ([{"name": "f", "function": "no_such_module_xyz:f"}], r"rewards\[0\]\.function: cannot import"),
        ([{"name": "f", "function": "tests.fixtures_tasks.reward_helpers:missing"}], r"rewards\[0\]\.function"),
        ([{"name": "f", "function": "/no/such/file.py:f"}], r"rewards\[0\]\.function: file"),
        ([{"name": "f", "function": "nocolon"}], r"rewards\[0\]\.function"),
        ([42], r"rewards\[0\]"),
        (["format", "format"], r"duplicate"),
    ],
)
def test_config_errors(entries, match):
    with pytest.raises(ConfigError, match=match):
        build_reward_manager(entries, ListTask(PROBLEMS))


def test_bad_policy():
    with pytest.raises(ConfigError, match="on_error"):
        build_reward_manager(["format"], ListTask(PROBLEMS), on_error="ignore")


def test_load_function_file_import_error(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('nope')\n")
    with pytest.raises(ValueError, match="RuntimeError: nope"):
        load_function(f"{f}:x")
