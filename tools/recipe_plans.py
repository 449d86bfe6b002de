"""Rewrites the plan outputs of docs/gpu.md's 8-GPU recipes ("<!-- plan: NAME -->" blocks) with what `podsrl plan`
prints today, after a change to the memory plan (tests/distributed/test_recipes.py says when they are stale).

    python tools/recipe_plans.py        # from the repository root
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from podsrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPU_MD = ROOT / "docs" / "gpu.md"
PLAN = re.compile(r"(<!-- plan: \S+ -->\n```bash\n(.*?)\n```\n```text\n)(.*?)(\n```)", re.S)


def todays_output(match: re.Match) -> str:
    argv = shlex.split(match.group(2).replace("\\\n", " "))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if main(argv[1:]) != 0:
            raise SystemExit(f"{' '.join(argv)} failed")
    return match.group(1) + out.getvalue().rstrip("\n") + match.group(4)


if __name__ == "__main__":
    text = GPU_MD.read_text(encoding="utf-8")
    updated, count = PLAN.subn(todays_output, text)
    GPU_MD.write_text(updated, encoding="utf-8")
    print(f"{count} plan outputs rewritten in {GPU_MD.relative_to(ROOT)}")
