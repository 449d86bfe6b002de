"""`podsrl eval` builds the run through the trainer's builders: a LoRA run's adapter is evaluated on top of its base,
and correctness is the `correct` reward alone (a failing extra reward under `skip` marks nothing wrong)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from podsrl.build import load_model, load_task, reward_manager, rollout_engine, verifier
from podsrl.cli import main
from podsrl.config import load_config
from podsrl.config.facts import run_facts
from podsrl.lora import save_adapter
from podsrl.run.evaluation import evaluate
from podsrl.run.warmup import base_weights
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
PRESET = str(ROOT / "podsrl" / "configs" / "grpo.yaml")
pytestmark = pytest.mark.usefixtures("one_thread")
# warm enough that some held-out answers are right (the regression test's warm-up: cached once per session)
WARMED = {"warmup.steps": 150, "warmup.target_accuracy": 0.3, "warmup.check_every": 25,
          "warmup.validation_size": 64, "task.args": "{operands: 2, digits: 1}"}


def _eval(capsys, overrides: list[str], *extra: str) -> dict:
    assert main(["eval", "--config", PRESET, *overrides, *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_of_a_lora_adapter_equals_the_in_process_model(tmp_path, warmup_cache, capsys):
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{"model.lora_rank": 4, "task.eval_size": 24})
    cfg = load_config(PRESET, overrides)
    model, tokenizer = load_model(cfg, None, base_weights(cfg), trainable=True)
    with torch.no_grad():  # a non-trivial adapter (B starts at zero)
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_adapter(model, tmp_path / "adapter")
    task, problems = load_task(cfg, tokenizer)
    expected = evaluate(rollout_engine(cfg, model, tokenizer, run_facts(cfg, torch.device("cpu")).compute_dtype), tokenizer, problems,
                        verifier(reward_manager(cfg, task), task), cfg.rollout.max_new_tokens, cfg.eval.samples,
                        cfg.rollout.temperature, cfg.rollout.top_p, cfg.eval.batch_size)
    got = _eval(capsys, overrides, "--model", str(tmp_path / "adapter"))
    assert got == pytest.approx(expected)
    base = _eval(capsys, overrides)  # no --model: the warm-up weights alone
    assert model.get_base_model() is not None and got != base


def test_eval_correctness_ignores_a_failing_extra_reward(tmp_path, warmup_cache, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("def fails(prompts, completions, **kw):\n    raise RuntimeError('broken')\n")
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{"task.eval_size": 24, "reward_on_error": "skip",
                                                                 **WARMED})
    plain = _eval(capsys, overrides)
    with_broken = _eval(capsys, overrides, f"rewards=[correct, {{name: extra, function: '{broken}:fails'}}]")
    assert plain["eval/accuracy"] > 0 and with_broken == plain
