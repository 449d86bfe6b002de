"""No module of the library passes 500 lines: past that a file holds more than one job (issue [house] split
config/__init__.py and moved engines/fast.py's weights copy out when they grew over it)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "podsrl"
MOST_LINES = 500


def test_no_module_over_500_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MOST_LINES}
    assert not long, f"modules over {MOST_LINES} lines (split them along what they hold): {long}"
