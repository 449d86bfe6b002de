"""The side a comparison expected, named before its runs (`podsrl compare --expect`), kept beside the runs so that a
later `podsrl compare` or `podsrl report` on the folder tests that same side: a side chosen once the results are seen
is no test (docs/statistics.md). Two-sided (no side) is recorded too, and is as binding."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from podsrl.errors import UserError
from podsrl.fileio import write_text_atomic

EXPECT_FILE = "expect.json"  # {"expect": "better" | "worse" | null}, written by the first `podsrl compare` on a folder
SIDES = ("better", "worse")


def recorded_expectation(folder: Path) -> tuple[bool, str | None]:
    """(whether the folder records a side, the side or None for two-sided)."""
    path = folder / EXPECT_FILE
    if not path.is_file():
        return False, None
    try:
        expect = json.loads(path.read_text(encoding="utf-8"))["expect"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path}: not a side podsrl compare wrote (expected {{\"expect\": \"better\"|\"worse\"|null}})")
    if expect is not None and expect not in SIDES:
        raise UserError(f"{path}: expect {expect!r} is not one of better, worse, null")
    return True, expect


def binding_expectation(folders: Iterable[Path], given: str | None) -> str | None:
    """The side to test the runs of `folders` for (compare folders, or run dirs inside one: label/seedN): the one
    recorded when their runs started, else `given`. A given side other than the recorded one is refused (exit 2), as
    are folders that recorded different sides."""
    places = {place for folder in folders for place in (folder, *list(folder.parents)[:2])}
    recorded = {place: side for place in sorted(places) for known, side in [recorded_expectation(place)] if known}
    sides = set(recorded.values())
    if len(sides) > 1:
        named = ", ".join(f"{folder / EXPECT_FILE}: {_name(side)}" for folder, side in recorded.items())
        raise UserError(f"these runs were started expecting different sides ({named}): report them apart")
    if not sides:
        return given
    folder, side = next(iter(recorded.items()))
    if given is not None and given != side:
        raise UserError(f"--expect {given}: the runs in {folder} were started expecting {_name(side)} "
                        f"({folder / EXPECT_FILE}); a side named after the runs is not a test (docs/statistics.md). "
                        "New runs in a new --out folder can name another side")
    return side


def record_expectation(folder: Path, given: str | None) -> str | None:
    """`podsrl compare` into `folder`: the side its runs test (binding_expectation), recorded before any run starts."""
    side = binding_expectation([folder], given)
    write_text_atomic(folder / EXPECT_FILE, json.dumps({"expect": side}) + "\n")
    return side


def _name(side: str | None) -> str:
    return side if side is not None else "no side (two-sided tests)"
