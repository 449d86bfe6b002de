"""A built-in episode task that needs a program: sums and products the model may compute with the `python` tool.

The problems are the plain task's with products (task.args.operators, "+*" here), e.g. "47*86+9=": a product of
two-digit numbers is beyond what the tiny model does in its head, and a one-line program computes it. The model may
answer at once, or call

    <tool_call>{"name": "python", "arguments": {"code": "print(47*86+9)"}}</tool_call>

read `<tool_response>4051\n</tool_response>` (what the program printed) and answer. The code runs in the sandbox of
podsrl/episodes/sandbox.py (a separate process with CPU-time, memory, output and wall-clock limits, no network); a
program that fails is answered with its error and counted under `episode/tool_faults/python`. The answer checked
is what follows the last tool response. The warm-up's reference episodes teach the call: a share `tool_share` of
them print the whole expression, read what it printed and give it as the answer; the rest answer at once, as in the
plain task. The plain task of the same problems (`arithmetic` with the same operators) is its baseline.
"""

from __future__ import annotations

import json
import random

from podsrl.batch import Problem
from podsrl.episodes.environment import ToolEnvironment
from podsrl.episodes.render import RESPONSE_END, RESPONSE_START
from podsrl.episodes.sandbox import SandboxLimits, python_tool
from podsrl.episodes.tools import CALL_END, CALL_START
from podsrl.errors import ConfigError
from podsrl.tasks.arithmetic import ArithmeticTask

OPERATORS = "+*"  # the task's default problems: sums and products
CPU_S = 1  # a one-line arithmetic program needs milliseconds; a runaway one is stopped early


def reference_call(expression: str) -> str:
    """The call that prints `expression`'s value, in the built-in model's format."""
    return CALL_START + json.dumps({"name": "python", "arguments": {"code": f"print({expression})"}}) + CALL_END


class ArithmeticPythonTask(ArithmeticTask):
    name = "arithmetic_python"
    # 1: reference episodes with python calls, validated on episodes (so episode.* counts in its warm-up key)
    warmup_version = 1
    # its answers are learned bare (short rows) first, on the same problems; warmup.episode_steps on reference
    # episodes then teach the calls
    plain_task = "arithmetic"
    runs_programs = True

    def __init__(self, tool_share: float = 0.5, operators: str = OPERATORS, **args) -> None:
        if isinstance(tool_share, bool) or not isinstance(tool_share, (int, float)) or not 0 <= tool_share <= 1:
            raise ConfigError(f"task.args.tool_share: must be a number in [0, 1] (the share of warm-up reference "
                              f"episodes that call python), got {tool_share!r}")
        super().__init__(operators=operators, **args)
        self.tool_share = float(tool_share)

    @classmethod
    def plain_args(cls, args: dict) -> dict:
        """The plain task's arguments for the same problems: this task's operators, which differ from its default."""
        return {"operators": OPERATORS, **{k: v for k, v in args.items() if k != "tool_share"}}

    def reference_turns(self, problem: Problem) -> list[tuple[str, str]]:
        """The answer at once, or (a share `tool_share`, drawn per problem) a program printing the expression, then
        the answer after what it printed (print's own line end included, as the sandbox answers)."""
        rng = random.Random(f"turns-{self.seed}-{problem.uid}")
        if rng.random() >= self.tool_share:
            return super().reference_turns(problem)
        call = reference_call(problem.prompt.removesuffix("="))
        response = f"{RESPONSE_START}{problem.answer}\n{RESPONSE_END}"
        return [(problem.prompt, call), (problem.prompt + call + response, self.reference_completion(problem))]

    def environment(self, tool_timeout_s: float) -> ToolEnvironment:
        # the sandbox's wall clock ends a slow program before the call's own timeout abandons its thread
        limits = SandboxLimits(cpu_s=CPU_S, wall_s=min(SandboxLimits.wall_s, tool_timeout_s / 2))
        return ToolEnvironment([python_tool(limits)], tool_timeout_s)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        """The plain task's check of the text after the episode's last tool response (all of it without one)."""
        return super().is_correct(completion.rpartition(RESPONSE_END)[2], problem)
