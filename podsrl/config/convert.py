"""YAML/CLI values to the typed config: each value coerced to its field's annotation, or a ConfigError naming the
dotted key."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

from podsrl.errors import ConfigError
from podsrl.options import config_key


def convert(value: Any, tp: Any, key: str) -> Any:
    """Coerce a YAML/CLI value to the annotated type, or raise ConfigError naming the key."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return build(tp, value, key + ".")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return convert(value, args[0], key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} at {key}")


# Top-level keys with this prefix are skipped (docker-compose's extension fields): a home for `&anchors`.
IGNORED_PREFIX = "x-"


def build(cls: type, values: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {config_key(f): f.name for f in dataclasses.fields(cls)}
    for k in values:
        if k not in names:
            close = [n for n in names if n.startswith(str(k)[:3])]
            advice = [f"did you mean {', '.join(prefix + c for c in sorted(close))}?"] if close else []
            if not prefix:  # where a YAML anchor's own key lands: docker-compose's convention (config/loader.py)
                advice.append(f"a top-level key starting with {IGNORED_PREFIX!r} is ignored: the place for YAML "
                             "anchors")
            hint = f" ({'; '.join(advice)})" if advice else ""
            raise ConfigError(f"{prefix}{k}: unknown config key{hint}")
    kwargs = {names[k]: convert(v, hints[names[k]], prefix + k) for k, v in values.items()}
    return cls(**kwargs)
