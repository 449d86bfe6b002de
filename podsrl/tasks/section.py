"""The config's task section, `task:`: tasks own it (podsrl.config composes it into Config), so a task reads its
section without importing the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from podsrl.options import option as _f
from podsrl.tasks.registry import DEFAULT_TASK, TASKS


@dataclass
class TaskConfig:
    # the names are the task registry's, checked when the config is loaded (a task registered later counts)
    name: str = _f(DEFAULT_TASK, "Task (podsrl.tasks.TASKS): " + ", ".join(
        f"'{name}' ({about})" for name, (_, about) in TASKS.items()) + ".")
    args: dict[str, Any] = _f({}, "Task-specific arguments (e.g. operands/digits/train_size/solution for arithmetic, "
                              "dataset path and columns).")
    eval_size: int = _f(2000, "Held-out problems; fixed by the task seed (0 = no eval set: trains, says so).", ge=0)
    seed: int = _f(1234, "Seed of the problem generator and held-out set (shared by every run of a comparison).")
    # Bring-your-own data: held-out set of dataset tasks and prompt length.
    eval_fraction: float = _f(0.05, "Dataset tasks without task.args.eval_split: fraction of the distinct questions "
                              "held out for evaluation (seeded by task.seed, at most task.eval_size, never "
                              "trained on; task.args.eval_fraction wins); 0 = no eval set.", ge=0, lt=1)
    max_prompt_length: int = _f(0, "Longest prompt in tokens (TRL: max_prompt_length); 0 = the model's context "
                                "minus rollout.max_new_tokens. Checked against the context at start-up.",
        ge=0, note="0 = the model's context")
    overlong_prompts: Literal["filter", "truncate_left", "error"] = _f(
        "filter", "Prompts longer than max_prompt_length: drop them (counted at start-up; verl: "
        "filter_overlong_prompts), keep their last tokens, or stop naming the file and row."
    )
