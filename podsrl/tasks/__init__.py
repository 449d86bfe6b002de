"""Task registry: built-in arithmetic (plain, or with a calculator or a python tool: episodes), datasets
(jsonl/csv/parquet/HF), reasoning-gym, a user's TRL environment or podsrl environment class over a dataset
(episodes).

TASKS is the one list of task names: the config's help for `task.name` and its check of the name come from it, and a
task's class says how the config builds it (`Task.from_config`) and what the warm-up reads of it (class attributes),
so adding a task is one entry here. `task.args` holds each task's own arguments; prompt formatting keys
(prompt_mode, system_prompt, template) apply to dataset and reasoning-gym tasks, which ask a real model in its chat
template by default.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from podsrl.errors import ConfigError
from podsrl.tasks.base import Task

if TYPE_CHECKING:
    from podsrl.config import TaskConfig

TASKS: dict[str, tuple[str, str]] = {  # task.name -> ("module:class", imported when asked for; what it is)
    "arithmetic": ("podsrl.tasks.arithmetic:ArithmeticTask", "built-in"),
    "arithmetic_tool": ("podsrl.tasks.arithmetic_tool:ArithmeticToolTask",
                        "built-in, episodes with a calculator tool: docs/episodes.md"),
    "arithmetic_python": ("podsrl.tasks.arithmetic_python:ArithmeticPythonTask",
                          "built-in, sums and products, episodes with a sandboxed python tool: docs/episodes.md"),
    "dataset": ("podsrl.tasks.datasets:DatasetTask", "jsonl/csv/parquet/HF"),
    "reasoning_gym": ("podsrl.tasks.reasoning_gym:ReasoningGymTask", "reasoning-gym's generators"),
    "trl_environment": ("podsrl.tasks.trl_environment:TRLEnvironmentTask",
                        "episodes in a TRL environment class"),
    "environment": ("podsrl.tasks.environment_task:EnvironmentTask",
                    "episodes in your podsrl environment class, task.args.factory: 'my_env.py:MyEnv'; "
                    "docs/episodes.md"),
}
DEFAULT_TASK = "arithmetic"


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


__all__ = ["DEFAULT_TASK", "TASKS", "Task", "build_task", "has_episodes", "task_class"]
