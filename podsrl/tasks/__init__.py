"""Task registry: built-in arithmetic (plain, or with a calculator tool: episodes), datasets (jsonl/csv/parquet/HF),
reasoning-gym, a user's TRL environment or podsrl environment class over a dataset (episodes).

`task.args` holds each task's own arguments; prompt formatting keys (prompt_mode, system_prompt, template) apply to
dataset and reasoning-gym tasks, which ask a real model in its chat template by default.
"""

from __future__ import annotations

import importlib
import inspect

from podsrl.config import TaskConfig
from podsrl.errors import ConfigError
from podsrl.tasks.base import Task

PROMPT_KEYS = ("prompt_mode", "system_prompt", "template")
CLASSES = {  # task.name -> (module, class), imported when asked for
    "arithmetic": ("podsrl.tasks.arithmetic", "ArithmeticTask"),
    "arithmetic_tool": ("podsrl.tasks.arithmetic_tool", "ArithmeticToolTask"),
    "dataset": ("podsrl.tasks.datasets", "DatasetTask"),
    "reasoning_gym": ("podsrl.tasks.reasoning_gym", "ReasoningGymTask"),
    "trl_environment": ("podsrl.tasks.trl_environment", "TRLEnvironmentTask"),
    "environment": ("podsrl.tasks.environment_task", "EnvironmentTask"),
}
ENVIRONMENT_KEYS = {"trl_environment": "environment", "environment": "factory"}  # the class each names


def task_class(name: str) -> type[Task]:
    if name not in CLASSES:
        raise ConfigError(f"task.name: unknown task {name!r} (choose from {', '.join(CLASSES)})")
    module, cls = CLASSES[name]
    return getattr(importlib.import_module(module), cls)


def has_episodes(name: str) -> bool:
    """Whether task `name`'s rollouts are episodes (its class gives an environment), known without building it."""
    return task_class(name).environment is not Task.environment


def _construct(cls, key: str, *args, **kwargs):
    """Call a task constructor, turning unknown/missing arguments into an error naming task.args."""
    try:
        inspect.signature(cls).bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"task.args ({key}): {e}") from None
    return cls(*args, **kwargs)


def _with_eval_set(args: dict, cfg: TaskConfig) -> dict:
    """A dataset's task args with its eval set's size (task.eval_size) and, where no eval split or file is given,
    the share of its questions held out (task.eval_fraction, unless the args say)."""
    args.setdefault("eval_limit", cfg.eval_size)
    if args.get("eval_split") is None and args.get("eval_path") is None:
        args.setdefault("eval_fraction", cfg.eval_fraction if cfg.eval_size else 0.0)
    return args


def build_task(cfg: TaskConfig, tokenizer=None) -> Task:
    args = dict(cfg.args)
    if cfg.name == "arithmetic":
        return _construct(task_class("arithmetic"), "arithmetic", seed=cfg.seed, eval_size=cfg.eval_size, **args)
    if cfg.name == "arithmetic_tool":
        return _construct(task_class("arithmetic_tool"), "arithmetic_tool", seed=cfg.seed, eval_size=cfg.eval_size,
                          **args)
    if cfg.name in ENVIRONMENT_KEYS:
        key = ENVIRONMENT_KEYS[cfg.name]
        for needed in ("path", key):
            if needed not in args:
                raise ConfigError(f"task.args.{needed}: a {cfg.name} task needs its dataset (path) and its "
                                  f"environment class ({key}: 'my_env.py:MyEnv' or 'module:MyEnv')")
        return _construct(task_class(cfg.name), cfg.name, args.pop("path"), seed=cfg.seed,
                          **_with_eval_set(args, cfg))
    prompt_args = {k: args.pop(k) for k in PROMPT_KEYS if k in args}
    from podsrl.tasks.templates import prompt_formatter

    mode = prompt_args.get("prompt_mode", "chat" if getattr(tokenizer, "chat_template", None) else "plain")
    formatter = prompt_formatter(tokenizer, mode, prompt_args.get("system_prompt"),
                                 prompt_args.get("template", "{question}"))
    if cfg.name == "dataset":
        if "path" not in args:
            raise ConfigError("task.args.path: a dataset task needs a file path or a Hugging Face dataset name")
        source = args.pop("path")
        return _construct(task_class("dataset"), "dataset", source, seed=cfg.seed, format_prompt=formatter,
                          **_with_eval_set(args, cfg))
    if cfg.name == "reasoning_gym":
        if "name" not in args:
            raise ConfigError("task.args.name: a reasoning_gym task needs a dataset name (e.g. chain_sum)")
        name = args.pop("name")
        return _construct(task_class("reasoning_gym"), "reasoning_gym", name, seed=cfg.seed, eval_size=cfg.eval_size,
                          format_prompt=formatter, **args)
    task_class(cfg.name)  # an unknown name: its ConfigError naming task.name
    raise AssertionError(f"task {cfg.name!r} is in CLASSES but not built here")
