"""`option(default, help)`: a dataclass field with its help text, the one way config sections declare keys.

A leaf module, so that a method's own section (podsrl/methods/<name>.py) and the core sections (podsrl/config/sections.py)
declare keys the same way without importing each other. docs/config.md is generated from the help texts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def option(default: Any, help: str, **kw: Any) -> Any:
    """A field with `help` in its metadata; mutable defaults (dict, list) are copied per instance."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


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
