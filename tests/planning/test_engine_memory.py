"""An engine declares the device memory it holds to sample (RolloutEngine.device_memory, planning/workload.py
EngineMemory), and the memory plan prices what it declares: `podsrl plan --memory` and optim.micro_batch_size=auto
work for any registered engine. Shown with the example engine of docs/architecture.md, registered as written: no KV
cache (a whole forward a step over every row at once) and no fused weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from podsrl.engines import engine_class
from podsrl.planning.workload import CACHE_BLOCK, EngineMemory
from tests.engines.test_example_engine import REGISTER, run_with_the_example

PLAN = REGISTER + r"""
import contextlib, io
from dataclasses import replace
from pathlib import Path

from podsrl.cli import main
from podsrl.config import load_config
from podsrl.memory_plan import auto_micro_batch, transformers_config, workload_from_config
from podsrl.planning import memory as mp
from podsrl.planning.workload import EngineMemory, model_shape

MODEL = "docs/models/qwen2.5-math-1.5b.json"
# bfloat16 masters: the fast engine samples them through fused copies (no weights copy of its own)
overrides = ["model.dtype=bfloat16", f"model.name_or_path={MODEL}", "rollout.max_new_tokens=512",
             "task.max_prompt_length=256"]
PRESET = "podsrl/configs/default.yaml"
plain, fast = (load_config(PRESET, overrides + [f"rollout.engine={name}"]) for name in ("plain", "fast"))
config = transformers_config(plain, MODEL)
shape, memory = model_shape(config), 24 * 2**30
work = workload_from_config(plain, 256, "cuda")
assert work.engine == EngineMemory(kv_cache=False, fused_weights=False, waves=False), work.engine

plan = mp.make_plan(shape, work, memory)
assert plan.generation["kv_cache"] == 0 and plan.generation["fused_weights"] == 0, plan.generation
assert plan.work.generation_rows == plan.work.rank_rows  # every row at once
assert plan.generation["workspace"] == mp.whole_sequence_workspace(shape, plan.work) > 0
assert plan.update[False]["fused_weights"] == 0
priced_as_fast = mp.make_plan(shape, workload_from_config(fast, 256, "cuda"), memory)
assert priced_as_fast.generation["kv_cache"] > 0 and priced_as_fast.update[False]["fused_weights"] > 0

# auto: the largest micro-batch beside what the engine declares, more rows than beside the fast engine's fused weights
rows = {cfg.rollout.engine: auto_micro_batch(cfg, config, 256, "cuda", 1, memory)[0] for cfg in (plain, fast)}
budget = int(memory * (1 - mp.RESERVE))
released = mp.with_rows_in_flight(shape, replace(work, kept_decode_state=False), budget)
assert rows["plain"] == mp.largest_micro_batch(shape, released, budget, False) > rows["fast"], rows

# the command line prints the same plan: no KV cache in generation's row
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert main(["plan", PRESET, *overrides, "rollout.engine=plain", "--memory", "--gpu-memory", "24GiB"]) == 0
row = next(line for line in out.getvalue().splitlines() if line.startswith("| generation"))
header = next(line for line in out.getvalue().splitlines() if line.startswith("| phase"))
cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
assert cells["kv_cache"] == "0.000" and float(cells["workspace"]) == round(plan.generation["workspace"] / 2**30, 3)
assert f"optim.micro_batch_size=auto -> {rows['plain']} rows" in out.getvalue(), out.getvalue()
print("ok", rows)
"""


def test_the_registered_engines_declare_what_the_plan_assumed_of_them():
    """The fast engine's description follows its cache_block option; ray and vllm keep the default, the fast
    engine's at its defaults, so their plans are the ones recorded in docs/gpu.md and the fixtures."""
    fast = engine_class("fast")
    assert fast.device_memory({}) == EngineMemory() == EngineMemory(True, CACHE_BLOCK, True, True)
    assert fast.device_memory({"cache_block": 16}).cache_block == 16
    for name in ("ray", "vllm"):
        assert engine_class(name).device_memory({}) == EngineMemory(), name


def test_the_hf_engine_declares_what_generate_holds_and_the_plan_prices_it(monkeypatch):
    """`rollout.engine: hf` is transformers' generate: one call over every row (no waves), a cache grown a position
    at a time (no blocks) and the model's own projections (no fused copies). Its declaration says so, the engine
    does so (one generate call over all rows), and the plan prices it: every row in flight,
    cache positions not rounded, no fused weights."""
    from podsrl.engines import SamplingParams
    from podsrl.engines.hf import HFEngine
    from podsrl.planning import memory as mp
    from podsrl.planning.workload import Workload, load_model_config, model_shape
    from tests.engines.test_engines import Tok, make_model, random_prompts

    declared = HFEngine.device_memory({})
    assert declared == EngineMemory(kv_cache=True, cache_block=1, fused_weights=False, waves=False)

    model = make_model("llama", peak=3.0, eos_bias=2.0)
    calls, generate = [], model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **kw: calls.append(len(kw["input_ids"])) or generate(*a, **kw))
    HFEngine(model, Tok()).generate(random_prompts([4, 8, 6]), [3, 2, 4], SamplingParams(max_new_tokens=5),
                                    torch.arange(9))
    assert calls == [9]  # every row in one call

    shape = model_shape(load_model_config(str(Path(__file__).parents[2] / "docs/models/qwen2.5-math-1.5b.json")))
    work = Workload(prompts=64, n=8, m=8, prompt_length=250, completion_length=500, dtype="bfloat16",
                    compute_dtype="bfloat16", device="cuda")
    hf, fast = (mp.make_plan(shape, replace(work, engine=engine), 24 * 2**30) for engine in (declared, EngineMemory()))
    assert hf.work.generation_rows == work.rank_rows == 512  # no waves: every row at once
    assert fast.work.generation_rows < work.rank_rows  # the fast engine's waves fit the device
    assert mp.kept_positions(hf.work) == 750 and mp.kept_positions(fast.work) == 768  # 750 rounded to 64
    assert hf.update[False]["fused_weights"] == 0 < fast.update[False]["fused_weights"]


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_the_plan_and_auto_micro_batch_price_the_example_engines_declared_memory(tmp_path):
    assert run_with_the_example(PLAN, tmp_path).startswith("ok")
