"""The methods read the run's config through `ConfigView` (podsrl/methods/base.py), a description of podsrl.config.Config
that keeps them from importing the config (which composes its sections from the method registry). The description
must stay true: every field it names is Config's, of its type, and every `cfg.<section>.<field>` a method reads
outside its own section is in it."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from podsrl.config import Config
from podsrl.methods import METHODS
from podsrl.methods.base import ConfigView

METHODS_DIR = Path(__file__).parents[2] / "podsrl" / "methods"


def views() -> dict[str, dict[str, type]]:
    """section -> {field: type} of ConfigView's nested views; top-level fields under ""."""
    hints = typing.get_type_hints(ConfigView)
    nested = {name: typing.get_type_hints(hint) for name, hint in hints.items() if hasattr(hint, "_is_protocol")}
    top = {name: hint for name, hint in hints.items() if name not in nested}
    return {"": top, **nested}


def test_every_field_of_the_view_is_configs_of_its_type():
    cfg = Config()
    for section, fields in views().items():
        owner = getattr(cfg, section) if section else cfg
        for name, hint in fields.items():
            assert hasattr(owner, name), f"ConfigView names {section or 'Config'}.{name}, which Config lacks"
            assert isinstance(getattr(owner, name), typing.get_origin(hint) or hint), (section, name, hint)


def chains(tree: ast.AST) -> set[tuple[str, ...]]:
    """The attribute chains read off `cfg` or `self.cfg`: ("rollout", "n") for `self.cfg.rollout.n`."""
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        while isinstance(node, ast.Attribute):
            names.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in ("cfg", "self") and names:
            names = names[1:] if node.id == "self" and names[0] == "cfg" else names if node.id == "cfg" else []
            if names:
                found.add(tuple(names[:2]))
    return found


def test_the_view_names_everything_a_method_reads_outside_its_own_section():
    own = set(METHODS)
    view = views()
    read = set().union(*(chains(ast.parse(path.read_text(encoding="utf-8"))) for path in METHODS_DIR.glob("*.py")))
    assert ("rollout", "n") in read and ("pods", "m") in read  # the scan sees both kinds
    for chain in sorted(read):
        section = chain[0]
        if section in own:
            continue
        assert section in view or section in view[""], f"a method reads cfg.{section}: add it to ConfigView"
        if section in view and len(chain) > 1:
            assert chain[1] in view[section], f"a method reads cfg.{'.'.join(chain)}: add it to ConfigView"
