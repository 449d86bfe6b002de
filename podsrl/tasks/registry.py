"""The task names (podsrl.tasks.TASKS): `task.name` -> its class as "module:class" (imported when asked for,
podsrl.tasks.task_class) and what it is. Adding a task is one entry here; podsrl/tasks/__init__.py says what the
registry feeds."""

from __future__ import annotations

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
