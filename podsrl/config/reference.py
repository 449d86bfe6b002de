"""The config reference (docs/config.md), generated from the section dataclasses' defaults and help texts."""

from __future__ import annotations

import dataclasses
import typing

from podsrl.config.sections import Config
from podsrl.options import config_key


def config_help(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field: the config reference in the README is generated from this."""
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
            sub = typing.get_type_hints(cls)[f.name]
            rows.extend(config_help(sub, prefix + config_key(f) + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((prefix + config_key(f), repr(default), f.metadata.get("help", "")))
    return rows


def config_reference_markdown() -> str:
    """The config reference (docs/config.md), generated from the dataclasses so it cannot go stale."""
    lines = ["# Configuration reference", "",
             "Every key, its default and what it does. Set them in a YAML file (`--config`) or on the command line "
             "as dotted overrides (`rollout.n=16`). Generated from `podsrl/config/sections.py` by "
             "`python -c \"from podsrl.config import config_reference_markdown as f; print(f(), end='')\" > docs/config.md`.",
             "", "A YAML file's top-level keys that start with `x-` are ignored (docker-compose's extension fields): "
             "the place for anchors that other keys merge, e.g. `x-short: &short {n: 4, max_new_tokens: 64}` "
             "then `rollout: {<<: *short, temperature: 0.7}`. Any other unknown key is refused, naming it.",
             "", "| key | default | meaning |", "|---|---|---|"]
    for key, default, text in config_help():
        lines.append(f"| `{key}` | `{default}` | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
