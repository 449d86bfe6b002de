"""`podsrl train` with an environment that starts processes, for the containment tests: `python -m
tests.faults.forking_envs train ...` is podsrl's CLI with the task `forking` registered (a test harness, as
hanging_envs.py). Its episodes are the arithmetic task's with a calculator; the first `task.args.times` calls of
`step` each do what `task.args.act` says, appending the pid of any process they start to `task.args.record`:
- fork_exit: fork; the child calls sys.exit(0) (the common mistake: it meant the child to end there);
- leave: start `sleep 300` and never wait for it;
- detach: a daemon by a double fork (its own session, `sleep 300`, its parent gone: nobody's child in the trainer);
- os_exit: end the whole process with os._exit(0)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

from podsrl.episodes.environment import ToolEnvironment
from podsrl.tasks.arithmetic_tool import ArithmeticToolTask, calculator


class ForkingEnvironment(ToolEnvironment):
    def __init__(self, task: ForkingTask, tool_timeout_s: float) -> None:
        super().__init__([calculator], tool_timeout_s)
        self.task = task

    def step(self, assistant_text: str):
        if next(self.task.steps) < self.task.times:
            self.task.act_once()
        return super().step(assistant_text)


class ForkingTask(ArithmeticToolTask):
    name = "forking"

    def __init__(self, act: str = "fork_exit", times: int = 1, record: str = "", **args) -> None:
        super().__init__(**args)
        self.act, self.times, self.record = act, times, record
        self.steps = itertools.count()  # step calls so far

    def act_once(self) -> None:
        if self.act == "os_exit":
            os._exit(0)
        if self.act == "fork_exit":
            pid = os.fork()
            if pid == 0:
                sys.exit(0)
        elif self.act == "detach":
            pid = self.detach()
        else:
            pid = subprocess.Popen(["sleep", "300"]).pid
        with open(self.record, "a") as f:
            f.write(f"{pid}\n")

    @staticmethod
    def detach() -> int:
        """The daemon's pid, told by the intermediate child before it exits."""
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.setsid()
            daemon = os.fork()
            if daemon == 0:
                os.execvp("sleep", ["sleep", "300"])
            os.write(write, f"{daemon}".encode())
            os._exit(0)
        os.close(write)
        pid = int(os.read(read, 32))
        os.close(read)
        os.waitpid(child, 0)
        return pid

    def environment(self, tool_timeout_s: float) -> ForkingEnvironment:
        return ForkingEnvironment(self, tool_timeout_s)


def main() -> None:
    sys.modules.setdefault("tests.faults.forking_envs", sys.modules[__name__])
    import podsrl.tasks
    from podsrl.cli import main as cli

    podsrl.tasks.TASKS["forking"] = ("tests.faults.forking_envs:ForkingTask", "a test's process-starting environment")
    sys.exit(cli())  # the process's own command line: supervised, as `podsrl train` is


if __name__ == "__main__":
    main()
