"""PYTHONPATH for the tests' subprocesses: this checkout first, then whatever the caller's PYTHONPATH already holds
(packages carried to a machine in a side folder, for one). No imports beyond the standard library: the fault
launcher's zygote imports it."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
