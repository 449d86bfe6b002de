"""Stopping decided groups (PODS's pods.stop_decided_groups): between turns the runner scores the episodes that
finished and asks the method's rule of each group; a decided group's live episodes stop there, generating no more
tokens, the selection trains the max-variance subset from the finished ones, an undecided group runs on, and the
generated-token count holds only what was generated. Off, or on a single-turn task, nothing changes."""

from __future__ import annotations

import itertools

import pytest
import torch

from podsrl.algo.selection import max_variance_decided
from podsrl.batch import Problem
from podsrl.config import EpisodeConfig, load_config
from podsrl.episodes.runner import EpisodeRunner, GroupStop, turn_seeds
from podsrl.errors import ConfigError
from podsrl.rewards import RewardManager, RewardSpec, merge_results
from podsrl.run.trainer import Trainer
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask
from tests.conftest import tiny_overrides
from tests.episodes.scripted import EOS_TEXT, TOKENIZER, ScriptedEngine
from tests.episodes.test_episode_task import EPISODES
from tests.episodes.test_runner import PARAMS, calculator_script, call


def by_seed(context: str, seed: int) -> str:
    """seed % 4: 0 answers right at once, 1 wrong at once, 2 calls the calculator then answers right, 3 calls it
    then answers wrong."""
    if seed % 4 >= 2:
        text = calculator_script(context, seed)
        return text if seed % 4 == 2 or not text.endswith(EOS_TEXT) else "x" + text
    answer = str(eval(context.split("=")[0]))  # the scripted prompt is a plain sum
    return (answer if seed % 4 == 0 else "x") + EOS_TEXT


def row_seeds(classes: list[int]) -> list[int]:
    """Distinct row seeds whose first turn's seed is of the given classes (seed % 4) of `by_seed`."""
    candidates = iter(range(10_000))
    seeds = []
    for c in classes:
        seeds.append(next(s for s in candidates if int(turn_seeds(torch.tensor([s]), 0)) % 4 == c))
    return seeds


def variance(values) -> float:
    return float(torch.tensor(values, dtype=torch.float64).var()) if len(values) > 1 else 0.0


def best_subset_variance(values, m: int) -> float:
    return max(variance(s) for s in itertools.combinations(values, m))


@pytest.mark.parametrize("m", [2, 3, 4, 5])
def test_a_decided_group_has_no_later_reward_that_raises_its_best_subset_variance(m):
    levels = (0.0, 0.5, 1.0)
    for k in range(m + 3):
        for finished in itertools.product(levels, repeat=k):
            decided = max_variance_decided(torch.tensor(finished), m)
            balanced = min(finished.count(1.0), finished.count(0.0)) >= m // 2 and \
                finished.count(1.0) + finished.count(0.0) >= m
            assert decided == balanced
            if decided:  # whatever two more episodes score, the best m-subset is among the finished
                for later in itertools.product(levels, repeat=2):
                    assert best_subset_variance(finished + later, m) == pytest.approx(best_subset_variance(finished, m))


class Scores:
    """A GroupStop's score: 1.0 for a correct episode, recording which rows it scored."""

    def __init__(self, task):
        self.task, self.rows = task, []

    def __call__(self, rows, groups, tokens, environments):
        self.rows += rows
        problem = Problem(uid="p", prompt="3+4=", answer="7")
        return torch.tensor([float(self.task.score(TOKENIZER.decode(t, skip_special_tokens=True), problem))
                             for t in tokens])


def test_the_runner_stops_a_decided_groups_live_episodes_and_runs_an_undecided_one_on():
    task = ArithmeticToolTask(seed=0, eval_size=0)
    engine = ScriptedEngine(by_seed)
    problem = Problem(uid="p", prompt="3+4=", answer="7")
    # group 0: two right and two wrong at once (decided for m=4), four calling; group 1: three right at once
    seeds = row_seeds([0, 0, 1, 1, 2, 3, 2, 3] + [0, 0, 0, 1, 2, 3, 2, 3])
    scores = Scores(task)
    stop = GroupStop(scores, lambda finished, live: max_variance_decided(finished, 4))
    runner = EpisodeRunner(engine, TOKENIZER, task, EpisodeConfig(max_turns=3, max_tokens=200))
    out = runner.run([problem, problem], [8, 8], PARAMS, torch.tensor(seeds), stop)
    assert out.stopped.tolist() == [False] * 4 + [True] * 4 + [False] * 8
    # the second turn went to group 1's callers alone: the stopped episodes generated no more tokens
    assert len(engine.calls) == 2 and len(engine.calls[1]["contexts"]) == 4
    lengths = out.generation.completion_mask.sum(1)
    first_turn = len(call("calculator", expression="3+4") + "<tool_response>7</tool_response>")  # one char a token
    assert lengths[4:8].tolist() == [first_turn] * 4  # a stopped episode holds its first turn and the tool's answer
    assert all(int(n) > first_turn for n in lengths[12:16])  # group 1's callers answered in a second turn
    assert sorted(scores.rows) == [0, 1, 2, 3] + list(range(8, 16))  # each finished episode scored once
    metrics = out.stats.metrics()
    assert metrics["episode/stopped"] == 4.0 and metrics["episode/ended_by_stopped"] == 4 / 16


def test_merged_scores_of_parts_equal_one_score_of_all_rows():
    task = ArithmeticToolTask(seed=0, eval_size=0)
    faulty = iter(range(100))

    def sometimes_none(prompts, completions, **columns):
        return [None if next(faulty) % 3 == 0 else float(len(c) % 2) for c in completions]

    def manager():
        return RewardManager([RewardSpec("correct", 1.0, lambda p, c, **k: [float(x == "7") for x in c]),
                              RewardSpec("odd", 0.5, sometimes_none)], task, on_error="skip")

    problems = [Problem(uid="a", prompt="3+4=", answer="7"), Problem(uid="b", prompt="1+1=", answer="2")]
    texts = ["7", "8", "77", "2", "7", "x", "2"]
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    whole = manager().score(problems, groups, texts)
    parts_manager, parts = manager(), []
    for rows in ([3, 0], [1, 5, 6], [2, 4]):  # scored in the order rows finished, not in row order
        faulty = iter([r for r in rows])  # the same rows faulty as in the whole call (row % 3 == 0)
        parts.append((rows, parts_manager.score(problems, groups[rows], [texts[r] for r in rows])))
    merged = merge_results(parts)
    assert torch.equal(merged.rewards.nan_to_num(-1), whole.rewards.nan_to_num(-1))
    assert torch.equal(merged.valid, whole.valid) and torch.equal(merged.correct, whole.correct)
    for name in whole.components:
        assert torch.equal(merged.components[name].nan_to_num(-1), whole.components[name].nan_to_num(-1))
    for key, value in whole.metrics.items():
        if not key.startswith("time/"):
            assert merged.metrics[key] == pytest.approx(value), key


def pods_trainer(tmp_path, warmup_cache, stop: bool, task: str = "arithmetic_tool") -> Trainer:
    extra = {**EPISODES, "rollout.max_new_tokens": 96} if task == "arithmetic_tool" else {}
    overrides = tiny_overrides(tmp_path, warmup_cache, **{
        **extra, "task.name": task, "method": "pods", "rollout.n": 8, "pods.m": 4,
        "pods.stop_decided_groups": stop, "rewards": "[correct]"})
    return Trainer(load_config(None, overrides))


def test_pods_trains_the_max_variance_subset_of_finished_episodes_and_counts_only_generated_tokens(
        tmp_path, warmup_cache):
    produced = {}
    for stop in (False, True):
        trainer = pods_trainer(tmp_path / str(stop), warmup_cache, stop)
        trainer.parts.producer.episodes.engine = ScriptedEngine(by_seed)
        produced[stop] = trainer.parts.producer.produce(0)
    off, on = produced[False], produced[True]
    every_off, = off.generated
    every_on, = on.generated
    assert every_off.num_rollouts == 32
    # the rows the runner let finish are those of the run without stopping, token for token, reward for reward
    lengths = every_off.completion_lengths()
    stopped = int(on.metrics["episode/stopped"])
    assert stopped > 0 and every_on.num_rollouts == 32 - stopped
    off_keys = {(int(g), tuple(ids[:int(n)].tolist())) for g, ids, n in
                zip(every_off.group_index, every_off.completion_ids, lengths)}
    assert {(int(g), tuple(ids[:int(n)].tolist())) for g, ids, n in
            zip(every_on.group_index, every_on.completion_ids, every_on.completion_lengths())} <= off_keys
    for g in range(4):
        group_on = every_on.rewards[every_on.group_index == g]
        group_off = every_off.rewards[every_off.group_index == g]
        kept_on = on.kept.rewards[on.kept.group_index == g]
        kept_off = off.kept.rewards[off.kept.group_index == g]
        if group_on.numel() < 8:  # stopped: its finished episodes were decided, and it trains a balanced 4
            assert max_variance_decided(group_on, 4)
            assert sorted(kept_on.tolist()) == [0.0, 0.0, 1.0, 1.0]
        else:  # ran on: the same batch as without stopping
            assert torch.equal(kept_on, kept_off)
        assert variance(kept_on.tolist()) == pytest.approx(best_subset_variance(group_off.tolist(), 4))
    # generated tokens: the model's of the finished episodes and of the stopped episodes' first turns, nothing more;
    # the tools' answers are the environment's tokens, counted apart
    assert off.generated_tokens == int(every_off.trained_mask.sum())
    assert off.environment_tokens == int(lengths.sum()) - off.generated_tokens > 0
    finished = int(every_on.trained_mask.sum())
    stopped_tokens = on.generated_tokens - finished
    assert 0 < stopped_tokens < off.generated_tokens - finished
    assert on.generated_tokens < off.generated_tokens and on.generated_rollouts == off.generated_rollouts == 32
    assert on.metrics["episode/trained_turns"] <= off.metrics["episode/trained_turns"]


def test_the_stop_rule_is_never_asked_for_a_single_turn_task(tmp_path, warmup_cache):
    trainer = pods_trainer(tmp_path, warmup_cache, True, task="arithmetic")
    assert trainer.parts.producer.episodes is None

    def never(*_args):
        raise AssertionError("asked for a single-turn task")

    trainer.parts.producer.method.episode_stop_rule = never
    produced = trainer.parts.producer.produce(0)
    assert sum(b.num_rollouts for b in produced.generated) == 4 * 8 and "episode/stopped" not in produced.metrics


@pytest.mark.parametrize("overrides, named", [
    (["pods.rule=random"], "pods.rule=max_variance"),
    (["pods.m=0"], "0 < pods.m < rollout.n"),
    (["rewards=[correct, format]"], "the `correct` reward alone"),
])
def test_stopping_needs_the_max_variance_rule_a_subset_and_rewards_in_0_1(overrides, named):
    base = ["method=pods", "rollout.n=8", "pods.m=4", "pods.stop_decided_groups=true"]
    with pytest.raises(ConfigError, match="pods.stop_decided_groups") as error:
        load_config(None, base + overrides)
    assert named in str(error.value)
