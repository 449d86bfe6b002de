"""The trainer is its loop: run/trainer.py stays under 300 lines, and no function there, nor in the assembly of its
parts and the checkpoint state beside it, passes 40 lines (issue [house]: `_build` had grown to 92 lines and the
file to 500, with auto micro-batch written into the config mid-build)."""

from __future__ import annotations

import ast
from pathlib import Path

RUN = Path(__file__).resolve().parents[2] / "podsrl" / "run"
LOOP_LINES = 300
FUNCTION_LINES = 40


def long_functions(source: str) -> dict[str, int]:
    """{name: lines} of the functions and methods in `source` over FUNCTION_LINES lines (docstrings included)."""
    tree = ast.parse(source)
    return {node.name: length for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and (length := node.end_lineno - node.lineno + 1) > FUNCTION_LINES}


def test_the_loop_is_short():
    lines = len((RUN / "trainer.py").read_text(encoding="utf-8").splitlines())
    assert lines < LOOP_LINES, f"run/trainer.py has {lines} lines: what is not the loop belongs in its own module"


def test_no_function_of_the_trainer_or_its_assembly_passes_40_lines():
    def body(lines: int) -> str:
        return "".join(f"    x{i} = {i}\n" for i in range(lines))

    assert long_functions(f"class A:\n  def f(self):\n{body(40)}\n  def g(self):\n    pass\n") == {"f": 41}
    assert long_functions(f"def f():\n{body(39)}") == {}  # 40 lines: not over
    for name in ("trainer.py", "assembly.py", "learner_state.py"):
        assert long_functions((RUN / name).read_text(encoding="utf-8")) == {}, name
