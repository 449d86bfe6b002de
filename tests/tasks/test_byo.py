"""Bring-your-own pieces, one at a time: data reading, held-out eval sets, prompt length, progress lines, trackers,
missing extras, broken reward functions and configurations that cannot learn."""

import io
import json
import logging

import pytest
import torch

from podsrl.batch import Problem
from podsrl.config import TaskConfig, load_config
from podsrl.errors import ConfigError, DataError, UserError
from podsrl.models.loading import build_char_tokenizer
from podsrl.reporting.tracking import MetricsLogger, StepProgress, normalize_report_to, read_metrics
from podsrl.rewards import RewardManager, RewardSpec, build_reward_manager
from podsrl.run.trainer import Trainer
from podsrl.tasks import build_task
from podsrl.tasks.datasets import DatasetTask, numeric_answer
from podsrl.tasks.prompt_length import PromptLimit, limit_task_prompts, resolve_limit
from tests.conftest import tiny_overrides

ROWS = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i:,}"} for i in range(400, 440)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------- data reading


def test_excel_csv_with_byte_order_mark(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes("question,answer\r\nWhat is 2+2?,#### 4\r\n".encode("utf-8-sig"))
    task = DatasetTask(str(path), answer_format="gsm8k")
    assert [(p.prompt, p.answer) for p in task.train_problems] == [("What is 2+2?", "4")]
    bom_jsonl = tmp_path / "bom.jsonl"
    bom_jsonl.write_bytes('{"question": "q", "answer": "#### 1"}\n'.encode("utf-8-sig"))
    assert DatasetTask(str(bom_jsonl), answer_format="gsm8k").train_problems[0].answer == "1"


def test_numeric_answers(tmp_path):
    assert [numeric_answer(v) for v in (42, 42.0, 3.5, "1,234", " 7 ", "x7", True)] == \
        ["42", "42", "3.5", "1234", "7", None, None]
    path = write_jsonl(tmp_path / "n.jsonl", [{"question": "a", "answer": 42}, {"question": "b", "answer": 2.5},
                                              {"question": "c", "answer": "#### 1,234"}])
    task = DatasetTask(str(path), answer_format="gsm8k")  # number cells need no '####'
    assert [p.answer for p in task.train_problems] == ["42", "2.5", "1234"]
    csv_path = tmp_path / "n.csv"  # CSV cells are text: a column of final answers reads with raw / auto
    csv_path.write_text("question,answer\na,42\nb,\"1,234\"\nc,x+1\n")
    assert [p.answer for p in DatasetTask(str(csv_path)).train_problems] == ["42", "1234", "x+1"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": 1}, {"question": "b", "answer": "7"}])
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2: no answer found in column 'answer'"):
        DatasetTask(str(bad), answer_format="gsm8k")  # a text without '####' under gsm8k is a wrong mapping


# ---------------------------------------------------------------- eval sets


def test_default_held_out_eval_set_never_overlaps_training(tmp_path, caplog):
    rows = ROWS + ROWS[:10]  # duplicated questions must land on one side only
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = TaskConfig(name="dataset", args={"path": str(path), "answer_format": "gsm8k"}, seed=5)
    with caplog.at_level(logging.INFO, "podsrl"):
        task = build_task(cfg)
    held = {p.uid for p in task.eval_set()}
    assert len(held) == 2 == len(task.eval_set())  # ceil(5% of 40 distinct questions)
    assert not held & {p.uid for p in task.train_problems}
    assert len(task.train_problems) + sum(r["question"] in {p.prompt for p in task.eval_set()} for r in rows) \
        == len(rows)
    assert "2 of 40 distinct questions (task.eval_fraction=0.05, seed 5) are held out" in caplog.text
    assert [p.uid for p in build_task(cfg).eval_set()] == [p.uid for p in task.eval_set()]  # seeded
    assert build_task(TaskConfig(name="dataset", args=cfg.args, eval_size=0)).eval_set() == []
    assert len(build_task(TaskConfig(name="dataset", args={**cfg.args, "eval_fraction": 0.1})).eval_set()) == 4


def test_eval_split_questions_seen_in_training_are_dropped(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:20])
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[15:25])
    task = DatasetTask(str(train), eval_split=str(test), answer_format="gsm8k")
    assert [p.answer for p in task.eval_set()] == [str(2 * i) for i in range(420, 425)]


def test_reasoning_gym_without_eval_set():
    pytest.importorskip("reasoning_gym")
    from podsrl.tasks.reasoning_gym import ReasoningGymTask

    assert ReasoningGymTask("chain_sum", size=10, eval_size=0).eval_set() == []


def test_a_run_without_eval_set_trains_and_says_so(tmp_path, warmup_cache, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(8)])
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{
        "warmup.steps": 0, "task.name": "dataset", "task.args": f"{{path: {path}}}", "task.eval_size": 0,
        "rewards": "[{name: correct, function: 'tests/fixtures/rewards_ones.py:ones_share'}]"})
    with caplog.at_level(logging.WARNING, "podsrl"):
        summary = Trainer(load_config(None, overrides)).train()
    assert summary["step"] == 2 and "eval/accuracy" not in summary
    assert "no eval set (task dataset:d.jsonl): training without held-out evaluation" in caplog.text
    assert not any("eval/accuracy" in r for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))


# ---------------------------------------------------------------- prompt length


def test_limit_against_context():
    assert resolve_limit(0, 8, 64) == 56 and resolve_limit(20, 8, 64) == 20 and resolve_limit(0, 8, None) is None
    with pytest.raises(ConfigError, match="task.max_prompt_length: 60 \\+ rollout.max_new_tokens 8 exceeds"):
        resolve_limit(60, 8, 64)
    with pytest.raises(ConfigError, match="rollout.max_new_tokens: 64 leaves no room"):
        resolve_limit(0, 64, 64)


@pytest.mark.parametrize("policy", ["filter", "truncate_left", "error"])
def test_overlong_prompts(tmp_path, policy, caplog):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "x" * 30 + "2+2=", "answer": "4"},
            {"question": "3+3=", "answer": "6"}]
    task = DatasetTask(str(write_jsonl(tmp_path / "d.jsonl", rows)))
    tok = build_char_tokenizer()  # one token per character
    if policy == "error":
        with pytest.raises(DataError, match=r"d\.jsonl: line 2: the prompt is 34 tokens, longer than the limit of 10"):
            limit_task_prompts(task, tok, 10, policy, 8, 64)
        return
    with caplog.at_level(logging.INFO, "podsrl"):
        assert limit_task_prompts(task, tok, 10, policy, 8, 64) == 10
    prompts = [p.prompt for p in task.train_problems]
    if policy == "filter":
        assert prompts == ["1+1=", "3+3="] and "train filtered: 1" in caplog.text
        assert sorted(task.problem(i).prompt for i in range(2)) == ["1+1=", "3+3="]
    else:
        assert prompts == ["1+1=", "xxxxxx2+2=", "3+3="] and "train truncated: 1" in caplog.text


def test_truncation_retokenises_within_the_limit():
    class Spacey:  # one token per character, but decoding adds a leading space (as sentencepiece tokenizers can)
        def __call__(self, text, add_special_tokens=False):
            def ids(t):
                return [ord(c) for c in t]
            return type("E", (), {"input_ids": [ids(t) for t in text] if isinstance(text, list) else ids(text)})

        def decode(self, ids, skip_special_tokens=False):
            return " " + "".join(map(chr, ids))

    kept, labels, filtered, truncated = PromptLimit(Spacey(), 3, "truncate_left").apply(
        [Problem("u", "abcdef", "1")], ["row 0"])
    assert (filtered, truncated, labels) == (0, 1, ["row 0"]) and kept[0].prompt == " ef"  # " def" is 4 tokens


# ---------------------------------------------------------------- progress and trackers


def test_plain_progress_lines_every_n_steps_and_at_the_end():
    out = io.StringIO()
    bar = StepProgress(5, label="train", every_steps=2, every_seconds=1e9, stream=out, live=False)
    for step in range(1, 6):
        bar.update(step, reward=0.5, train_acc=0.25, step_time=0.1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["train start", "train step 2/5", "train step 4/5",
                                                        "train step 5/5"]
    assert lines[-1].startswith("train step 5/5 | reward 0.500 | train_acc 0.250 | 0.10 s/step | elapsed ")
    assert lines[-1].endswith("eta 0:00:00")
    early = io.StringIO()  # a loop that stops early (warm-up reaching its target) still prints where it stopped
    bar = StepProgress(100, label="warm-up", every_steps=50, stream=early, live=False)
    bar.update(7, loss=1.0)
    bar.close()
    assert early.getvalue().splitlines()[-1].startswith("warm-up step 7/100 | loss 1.000")


def test_warm_up_prints_plain_lines_to_a_log_file(tmp_path, capsys):
    from podsrl.run.warmup import run_warmup

    cfg = load_config(None, [f"warmup.cache_dir={tmp_path}", "warmup.steps=4", "warmup.batch_size=4",
                             "warmup.check_every=2", "warmup.validation_size=4", "log.log_every=2",
                             "model.tiny.num_layers=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=32",
                             "warmup.target_accuracy=0"])
    run_warmup(cfg, progress=True)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["warm-up start", "warm-up step 2/4", "warm-up step 4/4"]
    assert lines[-1].startswith("warm-up step 4/4 | loss ")


def test_plain_progress_every_n_seconds(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("podsrl.reporting.tracking.time.monotonic", lambda: now[0])
    out = io.StringIO()
    bar = StepProgress(1000, every_steps=1000, every_seconds=30, stream=out, live=False)
    for step in range(1, 11):
        now[0] += 10
        bar.update(step, reward=1.0)
    assert [line.split(" | ")[0] for line in out.getvalue().splitlines()[1:]] == ["train step 3/1000",
                                                                                  "train step 6/1000",
                                                                                  "train step 9/1000"]
    assert "eta 0:49:70" not in out.getvalue() and "eta 2:46:10" in out.getvalue()  # 10 s/step, 991 to go


def test_report_to_values():
    assert normalize_report_to("wandb") == ["wandb"]
    assert normalize_report_to("none") == [] and normalize_report_to([]) == []
    assert normalize_report_to("all") == ["tensorboard", "wandb", "trackio"]
    assert normalize_report_to(["tensorboard", "trackio"], tensorboard=False) == ["trackio"]
    with pytest.raises(ConfigError, match="log.report_to: unknown tracker 'mlflow'"):
        normalize_report_to(["mlflow"])
    assert load_config(None, ["log.report_to=wandb"]).log.report_to == ["wandb"]


def test_wandb_offline_logs_run_name_config_and_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, ["wandb"], run_name="my-run", config={"rollout": {"n": 4}})
    logger.log({"step": 1, "reward": 0.5, "eval/accuracy": float("nan")})
    run = logger._trackers[0].run
    assert run.name == "my-run" and run.config["rollout"] == {"n": 4}
    logger.close()
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    resumed = MetricsLogger(tmp_path, ["wandb"], resume_step=1, run_name="my-run")  # continues the same run
    assert resumed._trackers[0].run.id == run.id
    resumed.close()
    import wandb

    wandb.teardown()  # stop this process's wandb service (and its WANDB_SERVICE variable) for later tests
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "reward": 0.5, "eval/accuracy": None}]


def test_trackio_local_logs_metrics(tmp_path, monkeypatch):
    pytest.importorskip("trackio")
    import trackio.sqlite_storage
    import trackio.utils

    for module in (trackio.utils, trackio.sqlite_storage):  # both hold the directory from import time
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    (tmp_path / "run").mkdir()
    logger = MetricsLogger(tmp_path / "run", ["trackio"], run_name="tr-run", project="podsrl-test",
                           config={"seed": 3})
    for step in (1, 2):
        logger.log({"step": step, "reward": 0.1 * step})
    logger.close()
    import trackio.sqlite_storage as storage

    logs = storage.SQLiteStorage.get_logs(project="podsrl-test", run="tr-run")
    assert [(r["step"], r["reward"]) for r in logs] == [(1, 0.1), (2, 0.2)]
    assert list((tmp_path / "trackio").glob("podsrl-test*.db"))  # stored locally, where we said


def test_tensorboard_gets_config_and_metrics(tmp_path):
    logger = MetricsLogger(tmp_path, ["tensorboard"], run_name="tb", config={"seed": 1})
    logger.log({"step": 1, "reward": 0.5})
    logger.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


# ---------------------------------------------------------------- missing extras, broken rewards, configs


def test_missing_math_verify_is_one_line_at_start_up(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else
                        real(name, *a))
    task = DatasetTask(str(write_jsonl(tmp_path / "d.jsonl", ROWS[:3])))
    with pytest.raises(UserError, match=r"needs the optional package 'math-verify', which is not installed: "
                                        r"pip install 'podsrl\[tasks\]'"):
        build_reward_manager(["correct"], task)


def test_missing_peft_names_its_extra(monkeypatch):
    import sys

    from podsrl.lora import apply_lora, load_adapter

    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(UserError, match=r"LoRA \(model.lora_rank > 0\) needs the optional package 'peft'.*"
                                        r"pip install 'podsrl\[tasks\]'"):
        apply_lora(torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match=r"needs the optional package 'peft'"):
        load_adapter(torch.nn.Linear(2, 2), "adapter")


class _Task(DatasetTask):
    def __init__(self):  # noqa: D107 - no file needed
        self.name = "t"


def test_reward_returning_one_value_for_the_batch_is_named_then_stops_the_run(caplog):
    def batch_mean(prompts, completions, **columns):
        return 0.5  # one number for the whole batch (TRL would broadcast it)

    def fine(prompts, completions, **columns):
        return [1.0] * len(completions)

    manager = RewardManager([RewardSpec("fine", 1.0, fine), RewardSpec("batch_mean", 1.0, batch_mean)], _Task(),
                            "zero", 5.0, max_faulty_calls=3)
    problems, group = [Problem("u", "p", "1")], torch.zeros(4, dtype=torch.long)
    with caplog.at_level(logging.WARNING, "podsrl"):
        manager.score(problems, group, ["a"] * 4)
        manager.score(problems, group, ["a"] * 4)
    assert caplog.text.count("batch_mean") == 1  # said once, on the first call
    assert "returned float (one value for the whole batch) instead of a list of 4 values" in caplog.text
    with pytest.raises(UserError, match="reward function 'batch_mean': every value was faulty in 3 calls in a row"):
        manager.score(problems, group, ["a"] * 4)


def test_training_with_a_batch_level_reward_is_told_at_once_and_stopped(tmp_path, warmup_cache, caplog):
    rewards = "[{name: correct}, {name: batch_mean, function: 'tests/fixtures/rewards_batch_mean.py:batch_mean'}]"
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{
        "rewards": rewards, "reward_max_faulty_calls": 3, "train.max_steps": 10, "train.save_every": 1})
    trainer = Trainer(load_config(None, overrides))
    with caplog.at_level(logging.WARNING, "podsrl"), pytest.raises(UserError) as info:
        trainer.train()
    first = [r for r in caplog.records if "batch_mean" in r.getMessage()]
    assert len(first) == 1 and "returned float (one value for the whole batch)" in first[0].getMessage()
    assert str(info.value).startswith("reward function 'batch_mean': every value was faulty in 3 calls in a row")
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward" in r]
    assert steps == [1, 2]  # stopped during step 3, checkpoints of steps 1-2 kept


def test_a_reward_that_recovers_resets_the_count():
    faulty_calls = iter([True, False, True, False, True, False, True, True])

    def flaky(prompts, completions, **columns):
        return [None] * len(completions) if next(faulty_calls) else [0.0] * len(completions)

    manager = RewardManager([RewardSpec("flaky", 1.0, flaky)], _Task(), "zero", 5.0, max_faulty_calls=2)

    def score():
        return manager.score([Problem("u", "p", "1")], torch.zeros(2, dtype=torch.long), ["a", "b"])

    for _ in range(7):  # three faulty calls in all, never two in a row: each good call resets the count
        score()
    with pytest.raises(UserError, match="reward function 'flaky': every value was faulty in 2 calls in a row"):
        score()  # the second faulty call in a row


def test_one_rollout_per_prompt_cannot_learn():
    with pytest.raises(ConfigError, match="rollout.n: 1 rollout per prompt makes every group advantage zero"):
        load_config(None, ["rollout.n=1"])
