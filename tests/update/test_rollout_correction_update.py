"""Rollout correction in the update: the weight multiplies the policy loss (and its gradient), masked sequences keep
their place in the token-mean denominator (TRL), several passes take the trainer's old log-probs, never the
sampler's, the trainer's own fp32 module as sampler leaves the loss unchanged within float rounding, and a training
run with the correction on logs its metrics."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from podsrl.config import load_config
from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.models.loading import build_char_tokenizer
from podsrl.reporting.tracking import read_metrics
from podsrl.run.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.update.test_shared_prompt import grads, make_batch, make_updater, rel, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5  # float32 sums of a few hundred terms, with weights exp(log 2) = 2 up to 1 ulp


def run(batch, *overrides: str, lr: float = 0.05) -> tuple[dict, torch.Tensor]:
    """One update of a fresh tiny model with SGD at `lr`: (metrics, gradient of its last mini-batch)."""
    model = tiny_model()
    updater = make_updater(model, True, "optim.max_grad_norm=0", *overrides)
    updater.optimizer.param_groups[0]["lr"] = lr
    metrics = updater.update(batch, torch.Generator().manual_seed(5))
    return metrics, grads(model).clone()


def trainer_logprobs(batch) -> torch.Tensor:
    model = tiny_model()
    updater = make_updater(model, True)
    model.train()
    return updater._precompute(model, batch)


def with_sampler(batch, sampler: torch.Tensor):
    out = batch.select_rows(torch.arange(batch.num_rollouts))
    out.sampler_logprobs = sampler * batch.completion_mask
    return out


def test_token_tis_scales_the_loss_and_gradient_by_the_truncated_ratio():
    batch = make_batch([4, 1, 3, 2], 128, seed=1)
    base_metrics, base_grad = run(batch, "algo.rollout_correction=none")
    sampled = with_sampler(batch, trainer_logprobs(batch) - math.log(2))  # every token ratio is 2
    for cap, factor in ((3.0, 2.0), (1.5, 1.5)):
        metrics, grad = run(sampled, "algo.rollout_correction=token_tis", f"algo.rollout_correction_cap={cap}")
        assert metrics["loss"] == pytest.approx(factor * base_metrics["loss"], rel=TOL)
        assert rel(grad, factor * base_grad) <= TOL
        assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(factor, rel=TOL)
        assert metrics["sampling/importance_sampling_ratio/clipped_fraction"] == (1.0 if cap < 2 else 0.0)
        assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(2), rel=TOL)


def test_sequence_mask_drops_the_sequences_outside_the_bound_and_keeps_their_tokens_in_the_denominator():
    batch = make_batch([4, 1, 3, 2], 128, seed=1)
    trainer = trainer_logprobs(batch)
    lengths = batch.completion_mask.sum(dim=1, keepdim=True)
    off = torch.tensor([0, 1, 0, 0, 0, 1, 0, 0, 1, 0], dtype=torch.bool)  # rows whose sampler is 4x less likely
    sampled = with_sampler(batch, trainer - torch.where(off[:, None], math.log(4) / lengths, 0.0))
    metrics, grad = run(sampled, "algo.rollout_correction=sequence_mask")
    # the same update with those rows' advantages zeroed: their loss and gradient vanish, their tokens still count
    # in token_mean's denominator (TRL multiplies the loss by the masked ratio and keeps the completion mask)
    zeroed = batch.select_rows(torch.arange(batch.num_rollouts))
    zeroed.advantages = batch.advantages.masked_fill(off, 0.0)
    base_metrics, base_grad = run(zeroed, "algo.rollout_correction=none")
    assert metrics["loss"] == pytest.approx(base_metrics["loss"], rel=TOL)
    assert rel(grad, base_grad) <= TOL
    assert metrics["sampling/importance_sampling_ratio/masked_fraction"] == pytest.approx(0.3)


def test_several_passes_take_the_trainers_old_log_probs_not_the_samplers():
    batch = make_batch([4, 1, 3, 2], 128, seed=1)
    sampled = with_sampler(batch, trainer_logprobs(batch) - math.log(2))
    # weights held still (lr 0), so every mini-batch sees the policy the batch was scored with: without a correction
    # the sampler stands in for the old policy and the PPO ratio is 2, clipped wherever the advantage is positive;
    # with one the old policy is the trainer's and the ratio is 1
    uncorrected, _ = run(sampled, "algo.rollout_correction=none", "optim.mini_batches=2", lr=0.0)
    corrected, _ = run(sampled, "algo.rollout_correction=token_tis", "optim.mini_batches=2", lr=0.0)
    assert uncorrected["clip_ratio/high_mean"] > 0.2
    assert corrected["clip_ratio/region_mean"] == 0.0
    assert corrected["sampling/importance_sampling_ratio/mean"] == pytest.approx(2.0, rel=TOL)


def test_the_trainers_own_fp32_module_as_sampler_leaves_the_update_unchanged():
    model, tokenizer = tiny_model().eval(), build_char_tokenizer()
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in ("12+34=", "7+5=", "3+3=")]
    out = FastEngine(model, tokenizer).generate(prompts, [4, 4, 4], SamplingParams(max_new_tokens=12,
                                                temperature=0.8), torch.arange(12))
    batch = make_batch([4, 4, 4], 128, seed=2)  # for its problems and advantages
    batch.prompt_ids, batch.prompt_mask, batch.completion_ids = out.prompt_ids, out.prompt_mask, out.completion_ids
    batch.completion_mask, batch.sampler_logprobs = out.completion_mask.float(), out.logprobs
    batch = batch.trim_padding()
    base_metrics, base_grad = run(batch, "algo.rollout_correction=none")
    for mode in ("token_tis", "sequence_mask"):
        metrics, grad = run(batch, f"algo.rollout_correction={mode}")
        # every weight is within 12 x 1e-5 of 1 (tests/algo/test_rollout_correction.py), so is the loss's scale
        assert metrics["loss"] == pytest.approx(base_metrics["loss"], rel=12 * TOL)
        assert rel(grad, base_grad) <= 12 * TOL
        assert abs(metrics["sampling/importance_sampling_ratio/max"] - 1) <= 12 * TOL


def test_a_run_with_the_correction_on_logs_its_metrics(tmp_path, warmup_cache, caplog):
    # float32 compute on every device (auto is bfloat16 on CUDA, sampled from a bfloat16 copy): ratio 1 is expected
    overrides = tiny_overrides(tmp_path, warmup_cache, **{"algo.rollout_correction": "token_tis",
                                                          "model.compute_dtype": "float32"})
    with caplog.at_level(logging.INFO, logger="podsrl"):
        Trainer(load_config(None, overrides)).train()
    assert sum("rollout correction token_tis" in r.message for r in caplog.records) == 1
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(records) == 2
    for r in records:  # the fast engine samples with the trained fp32 module: ratio 1 within float rounding
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) <= TOL
        assert r["sampling/importance_sampling_ratio/clipped_fraction"] == 0.0
        assert 0 <= r["rollout_corr/k3_kl"] <= TOL
