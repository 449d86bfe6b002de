"""`option(default, help)`: a dataclass field with its help text, the one way config sections declare keys.

A leaf module, so that a method's own section (podsrl/methods/<name>.py) and the core sections (podsrl/config.py)
declare keys the same way without importing each other. docs/config.md is generated from the help texts.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, **kw: Any) -> Any:
    """A field with `help` in its metadata; mutable defaults (dict, list) are copied per instance."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)
