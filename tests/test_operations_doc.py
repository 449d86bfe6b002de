"""docs/operations.md lists every exit code of podsrl/exit_codes.py, by number and name, and no code that is not
there: the one page a scheduler's operator reads stays in step with the one place the codes are defined."""

from __future__ import annotations

import re
from pathlib import Path

from podsrl.exit_codes import ExitCode

PAGE = Path(__file__).parents[1] / "docs" / "operations.md"


def listed_codes() -> dict[int, str]:
    """code -> name of each row of the page's exit-code table (`| 75 | `STOPPED_RESUMABLE` | ...`)."""
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|(.+)\|$", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE)
    for code, _, rest in rows:
        what, action = (cell.strip() for cell in rest.split(" | ", 1))
        assert what and action, f"docs/operations.md: code {code} says what happened and what to do"
    return {int(code): name for code, name, _ in rows}


def test_the_page_lists_every_exit_code_and_no_other():
    assert listed_codes() == {int(code): code.name for code in ExitCode}
