"""The complete example engine of docs/architecture.md, read from the page (so the two cannot drift): one module plus
one registry line, registered as written; it samples the fast engine's tokens (the same per-row uniforms over the
same logits), and the config takes it, its option and its traits from the registry alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

# Run in a fresh interpreter: the example registers as a module of podsrl.engines would, before anything reads the
# registry, and leaves this process's registry alone. REGISTER registers it from the module's file and the line (argv).
REGISTER = r"""
import importlib.util, sys

import podsrl.engines as engines

source, line = sys.argv[1:3]
spec = importlib.util.spec_from_file_location("podsrl.engines.plain", source)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
exec(f"engines.ENGINES.update({{{line}}})", {"engines": engines})
"""
RUN = REGISTER + r"""
import torch

from podsrl.config import ConfigError, load_config
from podsrl.engines import SamplingParams, build_engine
from tests.tiny_lm import TokStub, tiny_causal_lm

model = tiny_causal_lm(64, eos_bias=2.0)
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (3, 7, 5)]
seeds = torch.arange(12) * 7919
for params in (SamplingParams(max_new_tokens=12, temperature=1.0), SamplingParams(max_new_tokens=12, top_k=8,
               top_p=0.9, temperature=0.7), SamplingParams(max_new_tokens=12, greedy=True)):
    plain, fast = (build_engine(name, model, TokStub()).generate(prompts, [4, 4, 4], params, seeds)
                   for name in ("plain", "fast"))
    width = fast.completion_ids.shape[1]
    assert plain.completion_ids.shape[1] == width, (plain.completion_ids.shape, fast.completion_ids.shape)
    assert torch.equal(plain.completion_ids, fast.completion_ids) and torch.equal(plain.truncated, fast.truncated)
    assert torch.equal(plain.completion_mask, fast.completion_mask) and torch.equal(plain.group_index, fast.group_index)
    torch.testing.assert_close(plain.logprobs, fast.logprobs, atol=1e-4, rtol=0)
assert build_engine("plain", model, TokStub(), max_new_tokens_cap=2).generate(
    prompts, [1, 1, 1], SamplingParams(max_new_tokens=12), seeds[:3]).completion_ids.shape[1] <= 2

cfg = load_config(None, ["rollout.engine=plain", "rollout.engine_options.max_new_tokens_cap=4"])
assert cfg.rollout.engine == "plain"
for overrides, message in (
        (["rollout.engine=plain", "rollout.engine_options.max_new_tokens_cap=four"],
         "rollout.engine_options.max_new_tokens_cap: expected an integer"),
        (["rollout.engine=plain", "rollout.engine_options.max_rows=4"], "not an option of the 'plain' engine"),
        (["rollout.engine=plain", "train.async.enabled=true"], "which the update changes under it")):
    try:
        load_config(None, overrides)
    except ConfigError as e:
        assert message in str(e), (message, str(e))
    else:
        raise AssertionError(f"{overrides} loaded")
print("ok")
"""


def doc_example() -> tuple[str, str]:
    """(the module's source, the registry line) from the page's "How to add an engine" section."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## How to add an engine"):]
    module, line = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[:2]
    return module, line.strip()


def test_the_example_is_one_module_and_one_line():
    module, line = doc_example()
    assert len([ln for ln in module.splitlines() if ln.strip()]) <= 50
    assert line == '"plain": "podsrl.engines.plain:PlainEngine",'


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_the_example_engine_samples_the_fast_engines_tokens_and_loads_from_the_registry(tmp_path):
    assert run_with_the_example(RUN, tmp_path).endswith("ok")


def run_with_the_example(script: str, tmp_path: Path) -> str:
    """`script` (which starts with REGISTER) in a fresh interpreter with the page's example engine; its stdout."""
    module, line = doc_example()
    source = tmp_path / "plain.py"
    source.write_text(module, encoding="utf-8")
    out = subprocess.run([sys.executable, "-c", script, str(source), line], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()
