"""The resolved config of every preset in podsrl/configs/: the fixture that shows a change of the config code left
every preset's keys and values as they were.

    PYTHONPATH=$PWD python -m tests.preset_configs   # re-record tests/fixtures/preset_configs.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from podsrl.config import load_config, to_dict

PRESET_DIR = Path(__file__).parents[1] / "podsrl" / "configs"
FIXTURE = Path(__file__).parent / "fixtures" / "preset_configs.json"


def resolved_presets() -> dict[str, dict]:
    return {p.stem: to_dict(load_config(p)) for p in sorted(PRESET_DIR.glob("*.yaml"))}


def main() -> int:
    FIXTURE.write_text(json.dumps(resolved_presets(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
