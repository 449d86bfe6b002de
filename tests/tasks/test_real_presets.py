"""The GPU presets for a real model and dataset parse and start, with a tiny local stand-in for the model and a
fixture file for GSM8K (no network here); a LoRA run trains a few steps and its adapter reloads; a reasoning-gym
task trains a few steps."""

import json
from pathlib import Path

import pytest
import torch

from podsrl.config import TinyModelConfig, load_config
from podsrl.models.loading import build_char_tokenizer, build_tiny_model
from podsrl.reporting.tracking import read_metrics
from podsrl.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def stand_in_model(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128,
                                             max_position_embeddings=512), tokenizer)
    path = tmp_path / "stand-in"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _gsm8k_fixture(path: Path) -> Path:
    rows = [{"question": f"Tom has {a} apples and buys {b}. How many?", "answer": f"{a}+{b}\n#### {a + b}"}
            for a in range(1, 7) for b in range(1, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _stand_in_overrides(tmp_path, model_path, data, steps=2):
    return [f"model.name_or_path={model_path}", "model.dtype=float32", "model.lora_rank=4",
            f"task.args.path={data}", "task.args.eval_split=null", "task.args.eval_fraction=0.25",
            "task.args.prompt_mode=plain", "task.args.config=null", "task.eval_size=4", "rollout.prompts_per_step=2",
            "rollout.n=4", "pods.m=2", "rollout.max_new_tokens=6", f"train.max_steps={steps}", "eval.samples=0",
            "task.max_prompt_length=0",  # the stand-in's context (512) holds no preset's declared 512 + completion
            f"output_dir={tmp_path / 'run'}", "log.progress=false", "log.tensorboard=false", "log.plot=false"]


@pytest.mark.parametrize("preset", ["gsm8k_qwen_pods", "gsm8k_qwen_grpo"])
def test_gpu_preset_parses(preset):
    cfg = load_config(ROOT / "configs" / f"{preset}.yaml")
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.model.lora_rank == 64
    assert cfg.task.args["answer_format"] == "gsm8k"


def test_gsm8k_pods_preset_starts_with_a_stand_in_and_lora_adapter_reloads(tmp_path, stand_in_model):
    data = _gsm8k_fixture(tmp_path / "gsm8k.jsonl")
    # A reward a random model can already earn, so advantages (and LoRA gradients) are not all zero.
    ones = ROOT / "tests/fixtures/rewards_ones.py"
    cfg = load_config(ROOT / "configs/gsm8k_qwen_pods.yaml", _stand_in_overrides(tmp_path, stand_in_model, data)
                      + [f"rewards=[correct, '{ones}:ones_share']", "optim.lr=1e-2"])
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.parts.model.named_parameters() if "lora_B" in k}
    trainer.train()
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[-1]["rollouts/generated"] == 8 and steps[-1]["rollouts/trained"] == 4
    trained = dict(trainer.parts.model.named_parameters())
    assert any(not torch.equal(before[k], trained[k]) for k in before), "LoRA weights did not move"
    # The checkpoint holds the adapter; loaded onto the base it reproduces the trained policy.
    from podsrl.lora import load_adapter
    from podsrl.models.loading import load_pretrained
    from podsrl.run.checkpoint import latest_checkpoint

    base, tokenizer = load_pretrained(str(stand_in_model))
    reloaded = load_adapter(base, latest_checkpoint(tmp_path / "run") / "model")
    device = next(trainer.parts.model.parameters()).device
    reloaded.to(device)
    ids = tokenizer("Tom has 3 apples", return_tensors="pt").input_ids.to(device)
    trainer.parts.model.eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, trainer.parts.model(ids).logits, atol=1e-5)
    assert (tmp_path / "run" / "merged" / "config.json").is_file()


def test_reasoning_gym_task_trains_a_few_steps(tmp_path, stand_in_model):
    pytest.importorskip("reasoning_gym")
    overrides = [f"model.name_or_path={stand_in_model}", "task.name=reasoning_gym",
                 "task.args={name: chain_sum, size: 50, prompt_mode: plain, min_terms: 2, max_terms: 2, "
                 "min_digits: 1, max_digits: 1}", "task.eval_size=4", "rollout.prompts_per_step=2", "rollout.n=4",
                 "rollout.max_new_tokens=4", "train.max_steps=2", "eval.samples=0", "warmup.steps=0",
                 f"output_dir={tmp_path / 'rg'}", "log.progress=false", "log.tensorboard=false", "log.plot=false"]
    Trainer(load_config(None, overrides)).train()
    steps = [r for r in read_metrics(tmp_path / "rg" / "metrics.jsonl") if "reward" in r]
    assert len(steps) == 2 and "rewards/correct/mean" in steps[-1]
