"""`podsrl train` with an environment that hangs, for the signal tests: `python -m tests.faults.hanging_envs train
...` is podsrl's CLI with the task `hanging` registered (a test harness: podsrl takes custom environments through a
Task subclass). Its episodes are the arithmetic task's with a calculator; once `task.args.hang_after` episodes have
reset, the next ones hang for good in `reset`, in `step` or in a tool call (`task.args.hang`: reset | step | tool;
for tool, each turn is answered as if the model had called the tool `stuck`), touching `task.args.mark` as they
start to hang."""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path

from podsrl.batch import Problem
from podsrl.episodes.environment import ToolEnvironment
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask, calculator

MARK: list[str] = []  # the file touched when a call starts to hang


def forever() -> None:
    Path(MARK[0]).touch()
    threading.Event().wait()


def stuck(x: int) -> str:
    """Never returns.

    Args:
        x: anything.
    """
    forever()
    return ""


class HangingEnvironment(ToolEnvironment):
    def __init__(self, task: HangingTask, tool_timeout_s: float) -> None:
        super().__init__([calculator, stuck], tool_timeout_s)
        self.task, self.hangs = task, False

    def reset(self, problem: Problem) -> list[dict]:
        self.hangs = next(self.task.resets) >= self.task.hang_after
        if self.hangs and self.task.hang == "reset":
            forever()
        return super().reset(problem)

    def step(self, assistant_text: str):
        if self.hangs and self.task.hang == "step":
            forever()
        if self.hangs and self.task.hang == "tool":
            assistant_text = '<tool_call>{"name": "stuck", "arguments": {"x": 1}}</tool_call>'
        return super().step(assistant_text)


class HangingTask(ArithmeticToolTask):
    name = "hanging"

    def __init__(self, hang: str = "step", hang_after: int = 0, mark: str = "", **args) -> None:
        super().__init__(**args)
        self.hang, self.hang_after = hang, hang_after
        self.resets = itertools.count()  # episodes reset so far
        MARK[:] = [mark]

    def environment(self, tool_timeout_s: float) -> HangingEnvironment:
        return HangingEnvironment(self, tool_timeout_s)


def register() -> None:
    import podsrl.tasks

    podsrl.tasks.TASKS["hanging"] = ("tests.faults.hanging_envs:HangingTask", "a test's hanging environment")


def main() -> None:
    sys.modules.setdefault("tests.faults.hanging_envs", sys.modules[__name__])
    from podsrl.cli import main as cli

    register()
    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
