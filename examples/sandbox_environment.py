"""An environment that scores a model-written function by running tests on it in podsrl's sandbox.

The model answers with a Python function; the environment writes it and the tests into a sandbox's scratch
directory, runs the tests there (isolated: the model's code cannot reach the run, the reward or anything else of
the host; docs/episodes.md, "The sandbox"), and rewards 1.0 when they pass. The tests write a report file, which
comes back out of the sandbox. As a podsrl environment class (`task.name: environment`,
`task.args.factory: "examples/sandbox_environment.py:FunctionTests"`) or on its own:

    python examples/sandbox_environment.py
"""

from __future__ import annotations

import sys

from podsrl.sandbox import Sandbox, SandboxLimits

TESTS = """\
from solution import add
cases = [((2, 3), 5), ((-1, 1), 0), ((10**20, 1), 10**20 + 1)]
passed = sum(add(*args) == want for args, want in cases)
open("report.txt", "w").write(f"{passed}/{len(cases)} passed")
raise SystemExit(0 if passed == len(cases) else 1)
"""


class FunctionTests:
    """One episode: the prompt asks for `add`, the model's one answer is run against TESTS."""

    def __init__(self) -> None:
        self.score, self.report = 0.0, ""

    def reset(self, problem) -> list[dict]:
        return [{"role": "user", "content": "Write a Python function add(a, b) returning a + b."}]

    def step(self, assistant_text: str) -> tuple[list[dict], bool]:
        self.score, self.report = run_tests(assistant_text)
        return [], True

    def reward(self) -> float:
        return self.score


def run_tests(solution: str) -> tuple[float, str]:
    """(1.0 when the tests pass else 0.0, the tests' report)."""
    with Sandbox(SandboxLimits(cpu_s=5, wall_s=20.0)) as box:
        (box.path / "solution.py").write_text(solution)
        (box.path / "test_solution.py").write_text(TESTS)
        done = box.run([sys.executable, "-E", "-s", "test_solution.py"])  # -I would leave the scratch off sys.path
        report = box.path / "report.txt"  # written inside, copied back out
        text = report.read_text() if report.is_file() else done.stderr.decode("utf-8", "replace")[-200:]
        return float(done.returncode == 0 and not done.timed_out), text


if __name__ == "__main__":
    for answer in ["def add(a, b):\n    return a + b\n",
                   "def add(a, b):\n    return a - b\n",
                   "import os\nos.kill(os.getppid(), 9)\ndef add(a, b):\n    return a + b\n"]:
        print(run_tests(answer))
