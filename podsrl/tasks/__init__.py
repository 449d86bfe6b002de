"""Task registry: built-in arithmetic (plain, or with a calculator tool: episodes), datasets (jsonl/csv/parquet/HF),
reasoning-gym, a user's TRL environment over a dataset (episodes).

`task.args` holds each task's own arguments; prompt formatting keys (prompt_mode, system_prompt, template) apply to
dataset and reasoning-gym tasks, which ask a real model in its chat template by default.
"""

from __future__ import annotations

import inspect

from podsrl.config import TaskConfig
from podsrl.errors import ConfigError
from podsrl.tasks.base import Task

PROMPT_KEYS = ("prompt_mode", "system_prompt", "template")


def _construct(cls, key: str, *args, **kwargs):
    """Call a task constructor, turning unknown/missing arguments into an error naming task.args."""
    try:
        inspect.signature(cls).bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"task.args ({key}): {e}") from None
    return cls(*args, **kwargs)


def build_task(cfg: TaskConfig, tokenizer=None) -> Task:
    args = dict(cfg.args)
    if cfg.name == "arithmetic":
        from podsrl.tasks.arithmetic import ArithmeticTask

        return _construct(ArithmeticTask, "arithmetic", seed=cfg.seed, eval_size=cfg.eval_size, **args)
    if cfg.name == "arithmetic_tool":
        from podsrl.tasks.arithmetic_tool import ArithmeticToolTask

        return _construct(ArithmeticToolTask, "arithmetic_tool", seed=cfg.seed, eval_size=cfg.eval_size, **args)
    if cfg.name == "trl_environment":
        from podsrl.tasks.trl_environment import TRLEnvironmentTask

        for key in ("path", "environment"):
            if key not in args:
                raise ConfigError(f"task.args.{key}: a trl_environment task needs its dataset (path) and its TRL "
                                  "environment (environment: 'module:Class')")
        return _construct(TRLEnvironmentTask, "trl_environment", args.pop("path"), seed=cfg.seed, **args)
    prompt_args = {k: args.pop(k) for k in PROMPT_KEYS if k in args}
    from podsrl.tasks.templates import prompt_formatter

    mode = prompt_args.get("prompt_mode", "chat" if getattr(tokenizer, "chat_template", None) else "plain")
    formatter = prompt_formatter(tokenizer, mode, prompt_args.get("system_prompt"),
                                 prompt_args.get("template", "{question}"))
    if cfg.name == "dataset":
        from podsrl.tasks.datasets import DatasetTask

        if "path" not in args:
            raise ConfigError("task.args.path: a dataset task needs a file path or a Hugging Face dataset name")
        source = args.pop("path")
        args.setdefault("eval_limit", cfg.eval_size)
        if args.get("eval_split") is None and args.get("eval_path") is None:  # no eval set given: hold one out (task.eval_fraction, unless args say)
            args.setdefault("eval_fraction", cfg.eval_fraction if cfg.eval_size else 0.0)
        return _construct(DatasetTask, "dataset", source, seed=cfg.seed, format_prompt=formatter, **args)
    if cfg.name == "reasoning_gym":
        from podsrl.tasks.reasoning_gym import ReasoningGymTask

        if "name" not in args:
            raise ConfigError("task.args.name: a reasoning_gym task needs a dataset name (e.g. chain_sum)")
        name = args.pop("name")
        return _construct(ReasoningGymTask, "reasoning_gym", name, seed=cfg.seed, eval_size=cfg.eval_size,
                          format_prompt=formatter, **args)
    raise ConfigError(f"task.name: unknown task {cfg.name!r} (choose from arithmetic, arithmetic_tool, dataset, "
                      "reasoning_gym, trl_environment)")
