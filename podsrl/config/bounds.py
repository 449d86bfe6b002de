"""The single-field checks: every field's Bounds, declared on it with `option` (podsrl/options.py), checked over a
whole config in the order the fields are declared, the first value out of bounds a ConfigError naming its key."""

from __future__ import annotations

import dataclasses
from typing import Any

from podsrl.errors import ConfigError
from podsrl.options import config_key, field_bounds


def check_bounds(section: Any, prefix: str = "") -> None:
    """Raise ConfigError `<dotted key>: <why>` for the first field of `section` (a config dataclass, its
    subsections included) whose value is outside its declared Bounds."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), prefix + config_key(f)
        if dataclasses.is_dataclass(value):
            check_bounds(value, key + ".")
            continue
        bounds = field_bounds(f)
        problem = bounds.problem(value) if bounds is not None else None
        if problem is not None:
            raise ConfigError(f"{key}: {problem}")
