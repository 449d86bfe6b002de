"""PODS on TRL's GRPOTrainer: selection maths (hand-computed), batch slicing, config errors, and short CPU runs."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer

from podsrl.algo.advantages import grpo_advantages
from podsrl.algo.selection import select_rollouts
from podsrl.config import TinyModelConfig
from podsrl.integrations import trl_config
from podsrl.integrations.trl import (
    PODSConfigError,
    PODSGRPOConfig,
    PODSGRPOTrainer,
    pods_select,
    slice_batch,
)
from podsrl.models.loading import build_char_tokenizer, build_tiny_model

EPS = 1e-4


# ---------------------------------------------------------------- selection maths (no trainer)
def test_pods_select_max_variance_subset_advantages_by_hand():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3, 1.0, 1.0, 1.0, 1.0])
    sel = pods_select(rewards, num_generations=4, m=2, rule="max_variance")
    # Group 0 keeps {0.9, 0.1}; group 1 (all equal) keeps its two earliest rows.
    assert sel.rows.tolist() == [0, 1, 4, 5]
    a = 0.4 / (math.sqrt(0.32) + EPS)  # |r - mean| / (unbiased std of {0.1, 0.9} + eps)
    torch.testing.assert_close(sel.advantages, torch.tensor([-a, a, 0.0, 0.0]))
    assert not sel.padding.any()
    assert sel.metrics["pods/completions_generated"] == 8 and sel.metrics["pods/completions_selected"] == 4
    assert sel.metrics["pods/frac_reward_zero_std_after"] == 0.5
    assert torch.isnan(sel.logged_advantages[[2, 3, 6, 7]]).all()


def test_pods_select_normalize_over_group_and_batch_scale():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3])
    sel = pods_select(rewards, 4, 2, "max_variance", normalize_over="group")
    std = math.sqrt(0.35 / 3)  # unbiased std of all four rewards, mean 0.45
    torch.testing.assert_close(sel.advantages, torch.tensor([-0.35, 0.45]) / (std + EPS))
    sel = pods_select(rewards, 4, 2, "max_reward", scale="batch")
    assert sel.rows.tolist() == [1, 2]  # 0.9 and 0.5
    torch.testing.assert_close(sel.advantages, torch.tensor([0.2, -0.2]) / (math.sqrt(0.08) + EPS))
    sel = pods_select(rewards, 4, 2, "max_variance", scale="none")
    torch.testing.assert_close(sel.advantages, torch.tensor([-0.4, 0.4]))


def test_pods_select_filter_pads_to_steps_per_generation_and_handles_nan():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3, 1.0, 1.0, 1.0, 1.0])
    sel = pods_select(rewards, 4, 2, "max_variance", filter_zero_variance=True)
    assert sel.rows.tolist() == [0, 1] and sel.metrics["pods/groups_filtered_frac"] == 0.5
    # Four micro-steps need four rows: the two filtered rows come back with advantage 0.
    sel = pods_select(rewards, 4, 2, "max_variance", filter_zero_variance=True, steps_per_generation=4)
    assert sel.rows.tolist() == [0, 1, 4, 5] and sel.padding.tolist() == [False, False, True, True]
    assert sel.advantages[2:].abs().sum() == 0
    # Everything filtered: still one row per micro-step, all with advantage 0.
    sel = pods_select(torch.ones(8), 4, 2, "max_variance", filter_zero_variance=True, steps_per_generation=2)
    assert sel.rows.numel() == 2 and sel.padding.all() and sel.advantages.abs().sum() == 0
    # An unscorable (NaN) completion is ranked as its group's mean and trains with advantage 0.
    sel = pods_select(torch.tensor([0.0, float("nan"), 1.0, 1.0]), 4, 4, "none")
    assert sel.advantages[1] == 0 and torch.isfinite(sel.advantages).all()


def test_pods_select_process_slices_partition_the_global_selection():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 8, generator=g)
    full = pods_select(rewards, 8, 3, "max_variance")
    parts = [pods_select(rewards, 8, 3, "max_variance", local_rows=slice(s, s + 16)) for s in (0, 16, 32)]
    rows = torch.cat([p.rows + s for p, s in zip(parts, (0, 16, 32))])
    assert rows.tolist() == full.rows.tolist()
    torch.testing.assert_close(torch.cat([p.advantages for p in parts]), full.advantages)


def test_slice_batch_keeps_rows_of_every_per_completion_entry():
    batch = {
        "prompt_ids": torch.arange(12).view(4, 3),
        "advantages": torch.tensor([0.0, 1.0, 2.0, 3.0]),
        "importance_sampling_ratio": torch.ones(4, 1),
        "tags": ["a", "b", "c", "d"],
        "num_items_in_batch": torch.tensor(4),
        "old_per_token_logps": None,
    }
    out = slice_batch(batch, torch.tensor([1, 3]), 4)
    assert out["prompt_ids"].tolist() == [[3, 4, 5], [9, 10, 11]]
    assert out["advantages"].tolist() == [1.0, 3.0] and out["tags"] == ["b", "d"]
    assert out["importance_sampling_ratio"].shape == (2, 1)
    assert out["num_items_in_batch"].item() == 4 and out["old_per_token_logps"] is None


# ---------------------------------------------------------------- config validation
def _config(tmp_path, **kw) -> PODSGRPOConfig:
    base = {"output_dir": str(tmp_path), "per_device_train_batch_size": 8, "num_generations": 8, "pods_m": 4,
            "max_completion_length": 6, "max_steps": 2, "report_to": "none", "bf16": False, "use_cpu": True,
            "logging_steps": 1, "save_strategy": "no", "seed": 0, "learning_rate": 1e-2}
    return PODSGRPOConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"pods_m": 9}, "pods_m must lie in"),
        ({"pods_m": 0}, "pods_m must lie in"),
        ({"pods_rule": "top"}, "pods_rule must be one of"),
        ({"pods_rule": "none"}, "pods_m must equal num_generations"),
        ({"pods_normalize_over": "batch"}, "pods_normalize_over must be one of"),
        ({"pods_m": 1}, "advantage 0"),
        ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "pods_m": 3},
         "per_device_train_batch_size \\* pods_m"),
        ({"multi_objective_aggregation": "normalize_then_sum"}, "sum_then_normalize"),
    ],
)
def test_config_errors(tmp_path, kw, match):
    with pytest.raises(PODSConfigError, match=match):
        _config(tmp_path, **kw)


def test_config_defaults_and_micro_batch(tmp_path):
    cfg = _config(tmp_path, pods_m=None, pods_rule="none")
    assert cfg.pods_m == 8 and cfg.pods_train_micro_batch_size == 8
    assert _config(tmp_path, gradient_accumulation_steps=2).pods_train_micro_batch_size == 4
    assert isinstance(PODSConfigError("x"), ValueError)


def test_unsupported_trl_version_is_a_clear_import_error(monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "0.19.1")
    with pytest.raises(ImportError, match=r"trl>=1.0,<2.*found trl 0.19.1"):
        trl_config.require_trl()


# ---------------------------------------------------------------- short training runs on the tiny model
def _reward(prompts, completions, answer, **kwargs):
    # Continuous: digits in the completion plus a bonus for the right leading digit; prompts on an even first operand
    # score a constant (zero-variance groups for the filtering tests).
    out = []
    for prompt, completion, ans in zip(prompts, completions, answer):
        if int(prompt.split("+")[0]) % 2 == 0 and kwargs.get("constant_evens", True):
            out.append(1.0)
        else:
            digits = sum(c.isdigit() for c in completion) / 8
            out.append(digits + float(completion.startswith(ans[0])) + 0.01 * len(completion))
    return out


def _varied_reward(prompts, completions, answer, **kwargs):
    return _reward(prompts, completions, answer, constant_evens=False)


def _model_data():
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    pairs = [(a, b) for a in range(10, 18) for b in (11, 12)]
    ds = datasets.Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs],
                                     "answer": [str(a + b) for a, b in pairs]})
    return model, tok, ds


def _record(monkeypatch, trainer):
    """Record TRL's raw generated batches + rewards and every batch that reaches the loss."""
    raw, loss_batches = [], []
    orig_gen, orig_rewards = GRPOTrainer._generate_and_score_completions, GRPOTrainer._calculate_rewards

    def gen(self, inputs):
        out = orig_gen(self, inputs)
        raw[-1]["output"] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        return out

    def rewards(self, *args):
        r = orig_rewards(self, *args)
        raw.append({"rewards": r.sum(1).clone()})
        return r

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", gen)
    monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", rewards)
    orig_loss = trainer.compute_loss

    def compute_loss(model, inputs, *args, **kwargs):
        loss_batches.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        return orig_loss(model, inputs, *args, **kwargs)

    monkeypatch.setattr(trainer, "compute_loss", compute_loss)
    return raw, loss_batches


def _rows(batch, idx=None):
    idx = range(batch["prompt_ids"].size(0)) if idx is None else idx.tolist()
    return [(tuple(batch["prompt_ids"][i].tolist()), tuple(batch["completion_ids"][i].tolist()),
             round(float(batch["advantages"][i]), 5)) for i in idx]


def test_only_the_selected_m_reach_the_loss_with_podsrl_advantages(tmp_path, monkeypatch):
    model, tok, ds = _model_data()
    reward = _varied_reward
    args = _config(tmp_path, gradient_accumulation_steps=2)  # 16 generated (2 prompts x 8), 2 micro-steps of 4
    trainer = PODSGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    raw, loss_batches = _record(monkeypatch, trainer)
    trainer.train()
    assert len(raw) == 2 and len(loss_batches) == 4
    for gen, (first, second) in zip(raw, zip(loss_batches[::2], loss_batches[1::2])):
        assert first["prompt_ids"].size(0) == second["prompt_ids"].size(0) == 4  # 2 prompts * m / 2 micro-steps
        r, group = gen["rewards"], torch.arange(16) // 8
        kept = select_rollouts(r, group, 2, 4, "max_variance")
        adv = grpo_advantages(r[kept], group[kept], 2, "group")
        expected = {**gen["output"], "advantages": torch.zeros(16).index_copy(0, kept, adv)}
        assert sorted(_rows(first) + _rows(second)) == sorted(_rows(expected, kept))
        assert first["num_items_in_batch"] == (expected["completion_mask"][kept]).sum()
    logs = [h for h in trainer.state.log_history if "pods/completions_generated" in h]
    assert logs and all(h["pods/completions_generated"] == 16 and h["pods/completions_trained"] == 8 for h in logs)
    assert all(h["pods/reward_std_after"] >= h["pods/reward_std_before"] - 1e-9 for h in logs)


def test_m_equals_n_rule_none_matches_plain_grpo(tmp_path):
    common = {"output_dir": str(tmp_path), "per_device_train_batch_size": 8, "num_generations": 4,
              "max_completion_length": 6, "max_steps": 2, "report_to": "none", "bf16": False, "use_cpu": True,
              "save_strategy": "no", "seed": 3, "learning_rate": 1e-2, "logging_steps": 1}
    reward = _varied_reward
    params = []
    for trainer_cls, args in ((GRPOTrainer, GRPOConfig(**common)),
                              (PODSGRPOTrainer, PODSGRPOConfig(**common, pods_m=4, pods_rule="none"))):
        model, tok, ds = _model_data()
        start = [p.detach().clone() for p in model.parameters()]
        trainer_cls(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok).train()
        params.append([p.detach().clone() for p in model.parameters()])
    moved = max(float((a - b).abs().max()) for a, b in zip(start, params[0]))
    assert moved > 5e-3  # two Adam steps at lr 1e-2 moved the weights far beyond the tolerance below
    # Advantages are computed in float64 by podsrl and float32 by TRL; Adam magnifies that rounding on the
    # elements whose gradients are near zero, hence an absolute tolerance well under one update.
    for a, b in zip(*params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_zero_variance_filtering_trains_survivors_and_pads_with_zero_advantage(tmp_path, monkeypatch):
    model, tok, ds = _model_data()
    # Prompts come in shuffled; with 4 prompts per generation some are even (constant reward) and get filtered.
    args = _config(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=2, filter_zero_variance=True)
    trainer = PODSGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=ds, processing_class=tok)
    raw, loss_batches = _record(monkeypatch, trainer)
    trainer.train()
    for gen, pair in zip(raw, zip(loss_batches[::2], loss_batches[1::2])):
        r = gen["rewards"].view(4, 8)
        live = int((r.max(1).values - r.min(1).values > 1e-6).sum())
        seen = sum(b["prompt_ids"].size(0) for b in pair)
        assert pair[0]["prompt_ids"].size(0) == pair[1]["prompt_ids"].size(0) >= 1
        assert seen == max(2, live * 4)  # survivors (m=4 each), or one zero-advantage row per micro-step
        assert sum(int((b["advantages"] != 0).sum()) for b in pair) <= live * 4
    logs = [h for h in trainer.state.log_history if "pods/groups_filtered_frac" in h]
    assert any(h["pods/groups_filtered_frac"] > 0 for h in logs)


def test_everything_filtered_still_trains(tmp_path, monkeypatch):
    model, tok, ds = _model_data()
    args = _config(tmp_path, gradient_accumulation_steps=2, filter_zero_variance=True, max_steps=1)
    def constant(prompts, completions, **kw):
        return [0.5] * len(prompts)

    trainer = PODSGRPOTrainer(model=model, reward_funcs=constant, args=args, train_dataset=ds, processing_class=tok)
    _, loss_batches = _record(monkeypatch, trainer)
    trainer.train()
    assert [b["prompt_ids"].size(0) for b in loss_batches] == [1, 1]
    assert all(b["advantages"].abs().sum() == 0 for b in loss_batches)
    log = next(h for h in trainer.state.log_history if "pods/completions_padded" in h)
    assert log["pods/completions_padded"] == 2 and log["pods/groups_filtered_frac"] == 1.0


def test_trainer_rejects_plain_grpo_config(tmp_path):
    model, tok, ds = _model_data()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, report_to="none",
                      use_cpu=True, bf16=False, max_completion_length=4)
    with pytest.raises(PODSConfigError, match="PODSGRPOConfig"):
        PODSGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=ds, processing_class=tok)


def test_kl_reference_logps_are_computed_on_the_kept_rows_only(tmp_path, monkeypatch):
    model, tok, ds = _model_data()
    model.save_pretrained(tmp_path / "tiny")  # with beta > 0, TRL loads the reference model from a path
    args = _config(tmp_path, gradient_accumulation_steps=2, beta=0.1, max_steps=1)
    trainer = PODSGRPOTrainer(model=str(tmp_path / "tiny"), reward_funcs=_varied_reward, args=args,
                              train_dataset=ds, processing_class=tok)
    ref_rows: list[int] = []
    ref_forward = trainer.ref_model.forward
    monkeypatch.setattr(trainer.ref_model, "forward",
                        lambda *a, **kw: ref_rows.append(kw["input_ids"].size(0)) or ref_forward(*a, **kw))
    _, loss_batches = _record(monkeypatch, trainer)
    trainer.train()
    assert sum(ref_rows) == 8  # 2 prompts x m=4, not the 16 generated
    for batch in loss_batches:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        c = batch["completion_ids"].size(1)
        with torch.no_grad():
            logits = ref_forward(input_ids=ids, attention_mask=mask).logits[:, -c - 1 : -1]
        expected = logits.log_softmax(-1).gather(2, batch["completion_ids"].unsqueeze(2)).squeeze(2)
        keep = batch["completion_mask"].bool()
        torch.testing.assert_close(batch["ref_per_token_logps"][keep], expected[keep], rtol=1e-4, atol=1e-5)
