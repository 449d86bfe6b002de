"""Task registry: built-in arithmetic, datasets (jsonl/csv/parquet/HF), reasoning-gym."""

from __future__ import annotations

from podsrl.config import TaskConfig
from podsrl.errors import ConfigError
from podsrl.tasks.base import Task


def build_task(cfg: TaskConfig, tokenizer=None) -> Task:
    args = dict(cfg.args)
    if cfg.name == "arithmetic":
        from podsrl.tasks.arithmetic import ArithmeticTask

        try:
            return ArithmeticTask(seed=cfg.seed, eval_size=cfg.eval_size, **args)
        except TypeError as e:
            raise ConfigError(f"task.args: {e}") from None
    if cfg.name == "dataset":
        from podsrl.tasks.datasets import DatasetTask

        return DatasetTask.from_config(cfg, tokenizer)
    if cfg.name == "reasoning_gym":
        from podsrl.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask.from_config(cfg, tokenizer)
    raise ConfigError(f"task.name: unknown task {cfg.name!r} (choose from arithmetic, dataset, reasoning_gym)")
