"""The loop and the infrastructure name no method: every module outside podsrl/methods/ is checked for every
registered method's name (read from the registry, comments and docstrings included), so a method stays one file
and the code around it cannot grow a branch on one.

Exemptions, each with its reason:
- `grpo` is also the name of the core every method plugs into (the Method base class is plain GRPO, the GRPO
  advantage, TRL's GRPOTrainer), so it is not checked.
- podsrl/algo/ is the maths library the methods call: a kernel carries the name of the paper it implements
  (`aero_select`, `dynamo_modulation`), and it is chosen only by a method module.
- podsrl/integrations/ ports a method to another trainer (TRL's GRPOTrainer) and is named after what it ports.
- podsrl/experiments/step_costs.py predicts the cost of the down-sampling study's settings (generate n, train m).
- podsrl/config/removed_keys.py names the replacements of keys from the layout before methods were modules.
- podsrl/config/trl_names.py points TRL's names at the podsrl keys that do the same, method sections included.
"""

from __future__ import annotations

import re
from pathlib import Path

from podsrl.methods import METHODS

PACKAGE = Path(__file__).parents[2] / "podsrl"
CORE = {"grpo"}
EXEMPT_DIRS = ("methods", "algo", "integrations")
EXEMPT_FILES = {"experiments/step_costs.py", "config/removed_keys.py", "config/trl_names.py"}



def name_pattern(name: str) -> re.Pattern:
    """The method's name as a word, `_` or `-` between its parts (reinforce_ada, Reinforce-Ada), any case; a
    longer identifier that contains it (podsrl, dynamo_modulation) is not a match."""
    spelled = r"[_-]".join(re.escape(part) for part in name.split("_"))
    return re.compile(rf"(?<![a-z0-9_]){spelled}(?![a-z0-9_])", re.IGNORECASE)


def mentions(text: str) -> set[str]:
    return {name for name in METHODS if name not in CORE and name_pattern(name).search(text)}


def checked_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if p.relative_to(PACKAGE).parts[0] not in EXEMPT_DIRS
            and p.relative_to(PACKAGE).as_posix() not in EXEMPT_FILES]


def test_the_guard_reads_the_registry_and_finds_names():
    assert {"pods", "aero", "reinforce_ada"} <= set(METHODS)
    assert mentions("as in Reinforce-Ada and PODS's m") == {"reinforce_ada", "pods"}
    assert mentions("import podsrl; dynamo_modulation(x); aeronautics") == set()
    assert mentions((PACKAGE / "methods" / "aero.py").read_text(encoding="utf-8")) >= {"aero"}
    assert len(checked_modules()) > 30 and PACKAGE / "run" / "trainer.py" in checked_modules()


def test_no_module_outside_methods_names_a_method():
    found = {}
    for path in checked_modules():
        rel = path.relative_to(PACKAGE).as_posix()
        names = mentions(path.read_text(encoding="utf-8"))
        if names:
            found[rel] = sorted(names)
    assert not found, f"modules outside podsrl/methods/ name a method (reword, or move the code into it): {found}"
