"""Task registry: built-in arithmetic (plain, or with a calculator or a python tool: episodes), datasets
(jsonl/csv/parquet/HF), reasoning-gym, a user's TRL environment or podsrl environment class over a dataset
(episodes).

TASKS is the one list of task names: the config's help for `task.name` and its check of the name come from it, and a
task's class says how the config builds it (`Task.from_config`) and what the warm-up reads of it (class attributes),
so adding a task is one entry in TASKS (podsrl/tasks/registry.py). `task.args` holds each task's own arguments; prompt formatting keys
(prompt_mode, system_prompt, template) apply to dataset and reasoning-gym tasks, which ask a real model in its chat
template by default.
"""

from __future__ import annotations

import importlib

from podsrl.errors import ConfigError
from podsrl.tasks.base import Task
from podsrl.tasks.registry import DEFAULT_TASK, TASKS
from podsrl.tasks.section import TaskConfig


def task_class(name: str) -> type[Task]:
    if name not in TASKS:
        raise ConfigError(f"task.name: unknown task {name!r} (choose from {', '.join(TASKS)})")
    module, _, cls = TASKS[name][0].partition(":")
    return getattr(importlib.import_module(module), cls)


def has_episodes(name: str) -> bool:
    """Whether task `name`'s rollouts are episodes (its class gives an environment), known without building it."""
    return task_class(name).environment is not Task.environment


def build_task(cfg: TaskConfig, tokenizer=None) -> Task:
    return task_class(cfg.name).from_config(cfg, tokenizer)


__all__ = ["DEFAULT_TASK", "TASKS", "Task", "TaskConfig", "build_task", "has_episodes", "task_class"]
