"""The 8-GPU recipes of docs/gpu.md ("One node of 8 GPUs: recipes") cannot rot: each documented command runs as
written on 2 gloo ranks, with a small local model, a local data file and tiny sizes appended after the recipe's own
keys; each documented plan is what `podsrl plan` prints today, and each recipe's micro-batch is one its plan fits."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from podsrl.cli import main
from podsrl.config import TinyModelConfig, load_config
from podsrl.config.presets import preset_names, preset_path
from podsrl.models.loading import build_char_tokenizer, build_tiny_model
from podsrl.reporting.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[2]
GPU_MD = ROOT / "docs" / "gpu.md"
NAMES = [f"math-{size}-{method}" for size in ("1.5b", "7b-fsdp", "7b-lora") for method in ("grpo", "pods")] + [
    "math-7b-fsdp-grpo-kl"]  # verl's KL term (algo.beta=0.001): a sharded reference beside the policy
# a marker, then the command's fenced block; a plan's block is followed by its output's
BLOCK = re.compile(r"<!-- (recipe|plan): (\S+) -->\n```bash\n(.*?)\n```(?:\n```text\n(.*?)\n```)?", re.S)
TORCHRUN = ["torchrun", "--nproc_per_node", "8", "-m", "podsrl", "train", "--config"]
PLAN_FLAGS = ["--memory", "--gpu-memory", "80GiB", "--world-size", "8", "--model"]
TINY = {"prompts": 4, "n": 4, "m": 2}  # 2 prompts a rank


@functools.cache
def documented() -> dict[str, dict]:
    """name -> {"recipe": argv, "plan": argv, "output": the plan's documented output}."""
    found: dict[str, dict] = {}
    for kind, name, command, output in BLOCK.findall(GPU_MD.read_text(encoding="utf-8")):
        entry = found.setdefault(name, {})
        entry[kind] = shlex.split(command.replace("\\\n", " "))
        if kind == "plan":
            entry["output"] = output
    return found


def recipe_parts(name: str) -> tuple[str, list[str]]:
    """The recipe's preset and its overrides."""
    argv = documented()[name]["recipe"]
    return argv[len(TORCHRUN)], argv[len(TORCHRUN) + 1:]


def test_each_recipe_is_a_torchrun_of_a_shipped_preset_planned_with_the_same_keys():
    assert sorted(documented()) == sorted(NAMES)
    for name in NAMES:
        recipe, plan = documented()[name]["recipe"], documented()[name]["plan"]
        assert recipe[:len(TORCHRUN)] == TORCHRUN, name
        preset, overrides = recipe_parts(name)
        assert preset in preset_names(), name
        assert plan[:3] == ["podsrl", "plan", preset] and plan[3:3 + len(overrides)] == overrides, name
        assert plan[3 + len(overrides):-1] == PLAN_FLAGS and (ROOT / plan[-1]).is_file(), name


@pytest.mark.parametrize("name", NAMES)
def test_the_documented_plan_is_todays_and_fits_the_recipes_micro_batch(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the plan names docs/models/*.json from the repository root
    report = tmp_path / "plan.json"
    assert main([*documented()[name]["plan"][1:], "--json", str(report)]) == 0
    assert capsys.readouterr().out == documented()[name]["output"] + "\n", f"docs/gpu.md's plan of {name} is stale"
    preset, overrides = recipe_parts(name)
    cfg = load_config(preset_path(preset), overrides)
    fits = json.loads(report.read_text())["update"][
        "checkpointing" if cfg.update.activation_checkpointing else "no_checkpointing"]
    if cfg.optim.micro_batch_tokens:  # a token budget bounds the micro-batch, whatever its row cap
        assert 0 < cfg.optim.micro_batch_tokens <= fits["micro_batch_tokens"], (name, fits)
    else:
        assert 0 < cfg.optim.micro_batch_size <= fits["micro_batch_size"], (name, fits)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A small local model (the built-in char-level Qwen2, with the context the recipes' 512-token prompts need) and
    a MATH-shaped data file, in place of the hub's model and datasets."""
    root = tmp_path_factory.mktemp("recipes")
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64,
                                             max_position_embeddings=1024), tokenizer)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rows = [{"problem": f"What is {a} + {b}?", "solution": f"\\boxed{{{a + b}}}"} for a in range(1, 7) for b in range(4)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


def _value(cfg, key: str):
    return functools.reduce(getattr, key.split("."), cfg)


@pytest.mark.cpu_only("two gloo ranks on CPU under torchrun")
@pytest.mark.parametrize("name", NAMES)
def test_the_recipe_trains_a_step_on_two_gloo_ranks(name, stand_in, tmp_path):
    preset, overrides = recipe_parts(name)
    run = tmp_path / "run"
    tiny = [f"model.name_or_path={stand_in / 'model'}", f"task.args.path={stand_in / 'data.jsonl'}",
            "task.args.eval_path=null", "task.args.eval_split=null", "task.args.eval_fraction=0.25",
            "task.args.prompt_mode=plain", "task.eval_size=2", f"rollout.prompts_per_step={TINY['prompts']}",
            f"rollout.n={TINY['n']}", f"pods.m={TINY['m']}", "rollout.max_new_tokens=8", "train.max_steps=1",
            "log.progress=false", "log.tensorboard=false", "log.plot=false", f"output_dir={run}",
            # a reward an untrained model earns unevenly, so the step trains on non-zero advantages
            f"rewards=[correct, '{ROOT / 'tests' / 'fixtures_distributed.py'}:digit_share']"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv = documented()[name]["recipe"]
    proc = subprocess.run([*launcher, *argv[argv.index("-m"):], *tiny], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward" in r]
    m = TINY["m"] if preset.endswith("pods") else TINY["n"]
    assert [r["step"] for r in steps] == [1]
    assert steps[0]["rollouts/generated"] == TINY["prompts"] * TINY["n"]
    assert steps[0]["rollouts/trained"] == TINY["prompts"] * m and steps[0]["grad_norm"] > 0
    # the run kept every recipe key the tiny sizes do not replace
    ran, meant = load_config(run / "config.yaml", []), load_config(preset_path(preset), overrides)
    replaced = {item.split("=", 1)[0] for item in tiny}
    kept = [key for key, _ in (item.split("=", 1) for item in overrides) if key not in replaced]
    assert kept and all(_value(ran, key) == _value(meant, key) for key in kept), name
