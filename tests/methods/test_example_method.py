"""The complete example method of docs/architecture.md, read from the page (so the two cannot drift): one file plus
one registry line, built as written and trained for two steps on the built-in task."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

# Run in a fresh interpreter: Config is composed from the registry when podsrl.config is first imported, so the
# example registers before that, as a module of podsrl.methods would.
RUN = r"""
import importlib.util, json, sys
from pathlib import Path

import podsrl.methods as methods

source, line, run_dir, warmup_cache = sys.argv[1:5]
spec = importlib.util.spec_from_file_location("podsrl.methods.scaled", source)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
exec(f"methods.METHODS.update({{{line}}})", {"methods": methods, "Scaled": module.Scaled})

from podsrl.config import load_config, config_help
from tests.method_helpers import train_preset

assert ("scaled.factor", "0.5", "Multiplies every GRPO advantage.") in config_help()
records = train_preset("grpo", Path(run_dir), warmup_cache, method="scaled", **{"scaled.factor": 0.25,
                       "train.max_steps": 2})
print(json.dumps([r["step"] for r in records]))
"""


def doc_example() -> tuple[str, str]:
    """(the module's source, the registry line) from the page's "How to add a method" section."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## How to add a method"):]
    module, line = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[:2]
    return module, line.strip()


def test_the_example_is_one_short_file_and_one_line():
    module, line = doc_example()
    code = [ln for ln in module.splitlines() if ln.strip()]
    assert len(code) <= 20, len(code)
    assert line == '"scaled": Scaled,'


def test_the_example_method_trains_two_steps(tmp_path, warmup_cache):
    module, line = doc_example()
    source = tmp_path / "scaled.py"
    source.write_text(module, encoding="utf-8")
    out = subprocess.run([sys.executable, "-c", RUN, str(source), line, str(tmp_path / "run"), warmup_cache],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [1, 2]
