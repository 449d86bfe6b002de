import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from podsrl.errors import ConfigError, UserError
from podsrl.lora import apply_lora, export_merged, load_adapter, merged_state_dict, save_adapter

CONFIG = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def tiny_base(seed=0, **overrides):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**CONFIG, **overrides})).eval()


IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_lora_train_save_reload_and_merge(tmp_path):
    base_logits = logits(tiny_base())
    model = apply_lora(tiny_base(), rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert torch.equal(logits(model), base_logits)  # B starts at zero: the adapter is a no-op

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    opt.step()
    model.eval()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable and any(".lora_B." in n for n in changed)
    tuned = logits(model)
    assert not torch.allclose(tuned, base_logits)

    save_adapter(model, tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    reloaded = load_adapter(tiny_base(), tmp_path / "adapter")
    assert torch.equal(logits(reloaded), tuned)
    assert not any(p.requires_grad for p in reloaded.parameters())
    assert any(p.requires_grad for p in load_adapter(tiny_base(), tmp_path / "adapter", trainable=True).parameters())

    export_merged(model, tmp_path / "merged")
    weights = load_file(tmp_path / "merged" / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in weights)
    assert set(weights) == set(tiny_base().state_dict())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits(merged), tuned, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits(model), tuned)  # exporting left the adapter model as it was


def test_merged_weights_hand_computed():
    model = apply_lora(tiny_base(), rank=2, alpha=6, target_modules="q_proj")
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    want = layer.base_layer.weight + (6 / 2) * b @ a
    torch.testing.assert_close(merged_state_dict(model)["model.layers.0.self_attn.q_proj.weight"], want)


def test_all_linear_tied_embeddings_and_errors(tmp_path):
    model = apply_lora(tiny_base(tie_word_embeddings=True), rank=2)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("mlp.down_proj" in n for n in names) and not any("lm_head" in n for n in names)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.1)
    export_merged(model, tmp_path / "tied")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "tied").eval()
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(logits(merged), logits(model), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match=r"\['qq_proj'\] are not linear layers"):
        apply_lora(tiny_base(), target_modules=["q_proj", "qq_proj"])
    with pytest.raises(ConfigError, match="rank"):
        apply_lora(tiny_base(), rank=0)
    with pytest.raises(UserError, match="not a saved LoRA adapter"):
        load_adapter(tiny_base(), tmp_path)


def test_lora_reference_is_the_policy_with_its_adapters_disabled(tmp_path, warmup_cache):
    """LoRA with algo.beta > 0 loads no second model: the reference log-probs are the policy's with its adapters
    disabled, equal to those of the starting policy loaded on its own (the second copy it replaces), while the
    adapters (moved off their zero start) do change the policy's."""
    from podsrl.config import load_config
    from podsrl.models.loading import load_policy
    from podsrl.run.trainer import Trainer
    from tests.conftest import device_under_test, tiny_overrides

    overrides = tiny_overrides(tmp_path, warmup_cache, **{"rollout.n": 8, "pods.m": 4, "model.lora_rank": 4,
                                                          "algo.beta": 0.04})
    trainer = Trainer(load_config("podsrl/configs/pods.yaml", overrides))
    assert trainer.parts.ref_model is None
    with torch.no_grad():
        for name, p in trainer.parts.model.named_parameters():
            if "lora_" in name:
                p.add_(0.2 * torch.randn_like(p))
    batch = trainer.parts.producer.produce(0).kept
    reference = trainer.parts.updater.reference_logprobs(batch)
    base, _ = load_policy(trainer.cfg.model, trainer.parts.base_path, seed=trainer.cfg.seed)
    base.to(device_under_test()).eval()
    updater = trainer.parts.updater
    assert torch.allclose(reference, updater._precompute(base, batch), atol=1e-5)
    assert not torch.allclose(reference, updater._precompute(trainer.parts.model, batch), atol=1e-3)


def test_the_start_up_line_says_where_it_runs_and_what_trains(tmp_path, warmup_cache, caplog):
    """One line: the device and world size, master and compute dtypes, LoRA's rank, modules and trainable
    parameters (counted on the model), and the engine."""
    import logging

    from podsrl.config import load_config
    from podsrl.run.trainer import Trainer
    from tests.conftest import device_under_test, tiny_overrides

    overrides = tiny_overrides(tmp_path, warmup_cache, **{"rollout.n": 8, "pods.m": 4, "model.lora_rank": 4})
    with caplog.at_level(logging.INFO, logger="podsrl"):
        trainer = Trainer(load_config("podsrl/configs/pods.yaml", overrides))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run: ")]
    trained = sum(p.numel() for p in trainer.parts.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.parts.model.parameters())
    device = device_under_test()
    compute = "bfloat16" if device.type == "cuda" else "float32"
    assert lines == [f"run: one process on {trainer.dist.device}; master float32, compute {compute}; LoRA rank 4 on "
                     f"{','.join(trainer.cfg.model.lora_target_modules)}: {trained / 1e6:.2f}M trainable (float32) "
                     f"of {total / 1e6:.2f}M parameters; engine {trainer.parts.engine.name}"]
