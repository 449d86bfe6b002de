"""tools/check_deps.py's corners and tools/check_vllm_contract.py's comparison, without a registry: the drift tool is
fed vLLM sources made from the fake itself, then changed the way a new vLLM release would change them."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def contract():
    return load_tool("check_vllm_contract")


def vllm_sources(contract, fake_text: str, engine_args: set[str]) -> dict[str, ast.Module]:
    """The files the tool reads from a vLLM wheel, as the fake's source says they are."""
    runner = fake_text.replace("class Worker:", "class GPUModelRunner:")
    fields = "".join(f"    {name}: int = 0\n" for name in sorted(engine_args))
    files = {path: fake_text for _, path, _ in contract.SIGNATURES + contract.FIELD_SUBSETS}
    files |= {"vllm/v1/worker/gpu_model_runner.py": runner, "vllm/sampling_params.py": fake_text,
              "vllm/engine/arg_utils.py": f"class EngineArgs:\n{fields}"}
    return {path: ast.parse(text) for path, text in files.items()}


def test_vllm_contract_passes_on_the_same_source_and_names_each_drift(contract):
    text = contract.FAKE.read_text()
    fake = ast.parse(text)
    engine_args = contract.engine_args_in_fake(fake)
    assert contract.compare(fake, vllm_sources(contract, text, engine_args).__getitem__) == []

    drifted = text.replace("gpu_memory_utilization=0.92", "gpu_memory_utilization=0.9").replace(
        "    ignore_eos: bool = False\n", "    ignore_eos: bool = True\n")
    sources = vllm_sources(contract, drifted, engine_args | {"new_engine_field"})
    problems = contract.compare(fake, sources.__getitem__)
    assert len(problems) == 3, problems
    assert problems[0].startswith("LLM.__init__ vs vllm/entrypoints/llm.py:LLM.__init__") and "0.9'" in problems[0]
    assert problems[1] == "SamplingParams.ignore_eos's default: fake False, vLLM True"
    assert problems[2] == "EngineArgs' fields: only in the fake [], only in vLLM ['new_engine_field']"


def test_check_deps_corner_replaces_the_ranges_it_pins():
    deps = load_tool("check_deps")
    reqs = ["torch>=2.11,<2.15", "transformers>=5.17,<5.25", "peft>=0.21,<0.22", "numpy"]
    pins = deps.corner_pins("torch==2.13.0, transformers==5.17.0")
    assert deps.install_set(reqs, "range", False, pins) == (
        "torch==2.13.0", ["transformers==5.17.0", "peft>=0.21,<0.22", "numpy"])
    assert deps.install_set(reqs, "lowest", True, {}) == (
        "torch==2.11.*", ["transformers==5.17.*", "peft==0.21.*", "numpy"])
    with pytest.raises(SystemExit, match="'torch>=2.13' is not 'name==version'"):
        deps.corner_pins("torch>=2.13")
