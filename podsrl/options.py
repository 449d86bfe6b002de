"""`option(default, help, ...)`: a dataclass field with its help text and its bounds, the one way config sections
declare keys.

A leaf module, so that a method's own section (podsrl/methods/<name>.py) and the core sections (podsrl/config/sections.py)
declare keys the same way without importing each other. docs/config.md is generated from the help texts and bounds;
load_config refuses a value outside its field's bounds with one line naming the key (podsrl/config/bounds.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Bounds:
    """The values one field takes, declared on it: a range (pydantic's ge/gt/le/lt) and/or a `test` that refuses a
    value with `refusal`. Checks across fields are podsrl/config/checks.py's."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""  # what a boundary value means ("0 = off"), shown after the range
    test: Callable[[Any], bool] | None = None
    refusal: str = ""  # the message for a value `test` refuses

    def range_text(self) -> str:
        """The range as the reference page and the messages write it: ">= 1", "> 0", "in (0, 1]"."""
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = (">= " if low[0] == "[" else "> ") + low[1:]
        elif high:
            text = ("<= " if high[-1] == "]" else "< ") + high[:-1]
        else:
            return ""
        return text + (f" ({self.note})" if self.note else "")

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused (the message after the key), or None when it is in bounds."""
        outside = ((self.ge is not None and not value >= self.ge) or (self.gt is not None and not value > self.gt)
                   or (self.le is not None and not value <= self.le) or (self.lt is not None and not value < self.lt))
        if outside:
            return f"must be {self.range_text()}"
        if self.test is not None and not self.test(value):
            return self.refusal
        return None

    def text(self) -> str:
        """The bounds in one line, for the reference page."""
        return "; ".join(part for part in (self.range_text(), self.refusal if self.test else "") if part)


def option(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, note: str = "", test: Callable[[Any], bool] | None = None, refusal: str = "",
           **kw: Any) -> Any:
    """A field with `help` and its Bounds (ge/gt/le/lt, `note`, `test` with its `refusal`) in its metadata; mutable
    defaults (dict, list) are copied per instance."""
    metadata: dict[str, Any] = {"help": help}
    bounds = Bounds(ge, gt, le, lt, note, test, refusal)
    if bounds != Bounds():
        metadata["bounds"] = bounds
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def field_bounds(f: dataclasses.Field) -> Bounds | None:
    """The Bounds declared on a field with `option` (None: any value of its type)."""
    return f.metadata.get("bounds")


def config_key(f: dataclasses.Field) -> str:
    """The key a field has in YAML and on the command line: its name, unless that is a Python keyword (`async`),
    in which case the field names the key in its metadata."""
    return f.metadata.get("key", f.name)


def to_dict(cfg: Any) -> dict:
    """The config as plain data under its YAML keys (what load_config reads back)."""
    if dataclasses.is_dataclass(cfg):
        return {config_key(f): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return type(cfg)(to_dict(v) for v in cfg)
    return cfg
