"""A finite training pool for the built-in task (task.args.train_size): problems and uids wrap, the warm-up ignores
the pool, bad sizes are named, and DynaMO's allocation gets per-prompt history after the first epoch."""

from __future__ import annotations

import pytest

from podsrl.config import load_config
from podsrl.errors import ConfigError
from podsrl.reporting.tracking import read_metrics
from podsrl.run.trainer import Trainer
from podsrl.run.warmup import warmup_key
from podsrl.tasks import build_task
from tests.conftest import tiny_overrides


def task_with(args: str):
    return build_task(load_config(None, [f"task.args={args}", "task.eval_size=64"]).task)


def test_pool_wraps_with_repeating_uids():
    pool, stream = task_with("{train_size: 5}"), task_with("{}")
    assert len(pool) == 5 and len(stream) == 0
    for i in range(12):
        p = pool.problem(i)
        assert p.uid == f"train-{i % 5}"
        assert (p.prompt, p.answer) == (pool.problem(i % 5).prompt, pool.problem(i % 5).answer)
        assert p == stream.problem(i % 5)  # the pool is the stream's first problems
    assert stream.problem(7).uid == "train-7"
    held_out = {p.prompt for p in pool.eval_set()}
    assert not held_out & {pool.problem(i).prompt for i in range(5)}


@pytest.mark.parametrize("bad", ["-1", "2.5", "many", "true"])
def test_bad_train_size_is_named(bad):
    with pytest.raises(ConfigError, match=r"task\.args\.train_size"):
        task_with(f"{{train_size: {bad}}}")


def test_warmup_is_shared_with_the_unbounded_stream():
    key = warmup_key(load_config(None, ["task.args={operands: 2}"]))
    assert warmup_key(load_config(None, ["task.args={operands: 2, train_size: 64}"])) == key
    assert warmup_key(load_config(None, ["task.args={operands: 3}"])) != key


@pytest.mark.parametrize("refresh", ["step", "epoch"])
def test_allocation_gets_history_after_the_first_epoch(tmp_path, warmup_cache, refresh):
    extra = {"task.args": "{operands: 2, digits: 1, train_size: 8}", "method": "dynamo",
             "dynamo.n_min": 2, "dynamo.n_max": 6, "dynamo.refresh": refresh, "train.max_steps": 4}
    cfg = load_config("podsrl/configs/grpo.yaml", tiny_overrides(tmp_path / "run", warmup_cache, **extra))
    Trainer(cfg).train()
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward" in r]
    unknown = [r["alloc/frac_unknown"] for r in steps]
    assert unknown == [1.0, 1.0, 0.0, 0.0]  # 8 prompts at 4 a step: every prompt seen n=4 >= min_history times
    assert all(r["alloc/n_min"] >= 2 and r["alloc/n_max"] <= 6 and r["alloc/n_mean"] == 4 for r in steps)
