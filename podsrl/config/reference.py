"""The config reference (docs/config.md), generated from the section dataclasses' defaults, help texts and bounds."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator

from podsrl.config.sections import Config
from podsrl.options import config_key, field_bounds


def config_fields(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted key, field) for every leaf field of `cls` and its sections, in declaration order."""
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
            yield from config_fields(typing.get_type_hints(cls)[f.name], prefix + config_key(f) + ".")
        else:
            yield prefix + config_key(f), f


def _default(f: dataclasses.Field) -> object:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def config_help(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field: the config reference in the README is generated from this."""
    return [(key, repr(_default(f)), f.metadata.get("help", "")) for key, f in config_fields(cls, prefix)]


def config_reference_markdown() -> str:
    """The config reference (docs/config.md), generated from the dataclasses so it cannot go stale."""
    lines = ["# Configuration reference", "",
             "Every key, its default and what it does. Set them in a YAML file (`--config`) or on the command line "
             "as dotted overrides (`rollout.n=16`). Generated from `podsrl/config/sections.py` by "
             "`python -c \"from podsrl.config import config_reference_markdown as f; print(f(), end='')\" > docs/config.md`.",
             "", "A YAML file's top-level keys that start with `x-` are ignored (docker-compose's extension fields): "
             "the place for anchors that other keys merge, e.g. `x-short: &short {n: 4, max_new_tokens: 64}` "
             "then `rollout: {<<: *short, temperature: 0.7}`. Any other unknown key is refused, naming it.",
             "", "The bounds are declared on each field (`option(..., ge=1)`); a value outside them is refused when "
             "the config loads, with one line naming the key.",
             "", "| key | default | bounds | meaning |", "|---|---|---|---|"]
    for key, f in config_fields():
        bounds = field_bounds(f)
        text = bounds.text() if bounds is not None else ""
        lines.append(f"| `{key}` | `{_default(f)!r}` | {text.replace('|', '/')} | "
                     f"{f.metadata.get('help', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"
