"""Rollout correction (podsrl/algo/rollout_correction.py): every mode on a hand-computed case, the metrics, the `auto`
resolution (podsrl/config/facts.py), and the ratios of real samplers: the trainer's own fp32 module (1 within float rounding) and a bf16 copy
of it (not 1, and weighted exactly per the formula)."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from podsrl.algo.rollout_correction import rollout_correction, uncorrected_staleness
from podsrl.batch import Problem, RolloutBatch
from podsrl.config import TinyModelConfig, load_config
from podsrl.config.facts import run_facts
from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.engines.hf import HFEngine
from podsrl.models.loading import build_char_tokenizer, build_tiny_model
from podsrl.update.plain import plain_logprobs
from tests.update.test_shared_prompt import make_updater, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# Two rows, the second one token shorter. d = trainer - sampler log-prob is chosen so the token ratios are
# row 0: 2, 1/4, 5 and row 1: 1.5, 2.5 (its third column is padding, with a sampler value that must be ignored).
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
TRAINER = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]])
D = torch.tensor([[math.log(2), math.log(0.25), math.log(5)], [math.log(1.5), math.log(2.5), 0.0]])
SAMPLER = TRAINER - D
SAMPLER[1, 2] = -7.0  # padding


def weight(mode: str, cap: float = 3.0, cap_low: float = 0.0) -> torch.Tensor:
    return rollout_correction(TRAINER, SAMPLER, MASK, mode, cap, cap_low).weight


def test_token_tis_truncates_each_token_ratio_at_the_cap():
    # by hand: min(ratio, 3): 2, 0.25, 3 | 1.5, 2.5, padding 0
    torch.testing.assert_close(weight("token_tis"), torch.tensor([[2.0, 0.25, 3.0], [1.5, 2.5, 0.0]]))
    # a lower bound lifts 0.25 to it
    torch.testing.assert_close(weight("token_tis", cap_low=0.5), torch.tensor([[2.0, 0.5, 3.0], [1.5, 2.5, 0.0]]))


def test_token_mask_zeroes_tokens_outside_the_bounds_and_keeps_the_ratio_inside():
    out = rollout_correction(TRAINER, SAMPLER, MASK, "token_mask", 3.0, 0.5)
    torch.testing.assert_close(out.weight, torch.tensor([[2.0, 0.0, 0.0], [1.5, 2.5, 0.0]]))
    assert out.keep.tolist() == [[True, False, False], [True, True, False]]


def test_sequence_modes_use_the_product_of_the_token_ratios():
    # by hand: row 0: 2 * 0.25 * 5 = 2.5 (inside [0, 3]); row 1: 1.5 * 2.5 = 3.75 (above 3)
    out = rollout_correction(TRAINER, SAMPLER, MASK, "sequence_mask", 3.0)
    torch.testing.assert_close(out.weight, torch.tensor([[2.5, 2.5, 2.5], [0.0, 0.0, 0.0]]))
    assert out.keep.tolist() == [[True, True, True], [False, False, False]]
    torch.testing.assert_close(weight("sequence_tis"), torch.tensor([[2.5, 2.5, 2.5], [3.0, 3.0, 0.0]]))
    # a bound of 4 keeps both; a lower bound of 2.6 masks row 0 instead
    torch.testing.assert_close(weight("sequence_mask", cap=4.0), torch.tensor([[2.5, 2.5, 2.5], [3.75, 3.75, 0.0]]))
    torch.testing.assert_close(weight("sequence_mask", 4.0, 2.6), torch.tensor([[0.0, 0.0, 0.0], [3.75, 3.75, 0.0]]))


def test_metrics_by_hand():
    m = rollout_correction(TRAINER, SAMPLER, MASK, "token_tis", 3.0).metric_values()
    log = math.log
    expected = {
        "sampling/sampling_logp_difference/mean": log(2 * 4 * 5 * 1.5 * 2.5) / 5,  # mean |d| over the 5 tokens
        "sampling/sampling_logp_difference/max": log(5),
        "sampling/importance_sampling_ratio/min": 0.25,  # after truncation, over tokens
        "sampling/importance_sampling_ratio/mean": (2 + 0.25 + 3 + 1.5 + 2.5) / 5,
        "sampling/importance_sampling_ratio/max": 3.0,
        "sampling/importance_sampling_ratio/clipped_fraction": 1 / 5,
        "rollout_corr/kl": -log(2 * 0.25 * 5 * 1.5 * 2.5) / 5,  # k1: mean(-d)
        "rollout_corr/k3_kl": (2 + 0.25 + 5 + 1.5 + 2.5 - log(9.375) - 5) / 5,  # mean(exp(d) - d - 1)
    }
    assert m.keys() == expected.keys()
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-6), k
    seq = rollout_correction(TRAINER, SAMPLER, MASK, "sequence_mask", 3.0).metric_values()
    # over sequences: 2.5 kept, 3.75 masked to 0
    assert seq["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.25)
    assert seq["sampling/importance_sampling_ratio/min"] == 0.0
    assert seq["sampling/importance_sampling_ratio/masked_fraction"] == 0.5


def test_unknown_log_probs_are_left_uncorrected_and_the_weight_carries_no_gradient():
    trainer = TRAINER.clone().requires_grad_(True)
    sampler = SAMPLER.clone()
    sampler[0, 0] = float("nan")  # a token the sampler could not score
    out = rollout_correction(trainer, sampler, MASK, "token_tis", 3.0)
    assert out.weight[0, 0] == 1.0 and not out.weight.requires_grad
    empty = rollout_correction(torch.zeros(0, 1), torch.zeros(0, 1), torch.zeros(0, 1), "sequence_mask", 3.0)
    assert empty.weight.shape == (0, 1) and all(v == 0 for v in empty.metric_values().values())


def test_none_is_not_a_mode_of_the_function():
    with pytest.raises(ValueError, match="mode must be one of"):
        rollout_correction(TRAINER, SAMPLER, MASK, "none", 3.0)


def resolve_rollout_correction(cfg, device):
    return run_facts(cfg, device).rollout_correction


def mismatch_kinds(cfg, device):
    return run_facts(cfg, device).mismatch


def test_auto_resolves_per_mismatch_kind():
    """TRL's default (sequence_mask) for another engine's rollouts and for stale weights; token-level truncation for
    a precision-only mismatch (a sequence ratio multiplies the rounding gaps of every token: docs/results.md);
    none where the sampler is the trained module in its own precision."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg = load_config(None, [])
    assert cfg.algo.rollout_correction == "auto"
    assert resolve_rollout_correction(cfg, cpu) == "none"  # the fast engine samples with the trained fp32 module
    assert mismatch_kinds(cfg, cpu) == ()
    for engine in ("hf", "ray"):
        assert resolve_rollout_correction(load_config(None, [f"rollout.engine={engine}"]), cpu) == "none"
    vllm = load_config(None, ["rollout.engine=vllm"])
    assert resolve_rollout_correction(vllm, cpu) == "sequence_mask" and mismatch_kinds(vllm, cpu) == ("engine",)
    # a bfloat16 sampling copy of float32 masters: precision only
    assert resolve_rollout_correction(cfg, cuda) == "token_tis"  # compute_dtype auto: bfloat16 on CUDA
    assert mismatch_kinds(cfg, cuda) == ("precision",)
    bf16 = load_config(None, ["model.compute_dtype=bfloat16"])
    assert resolve_rollout_correction(bf16, cpu) == "token_tis"
    assert resolve_rollout_correction(load_config(None, ["model.compute_dtype=bfloat16", "rollout.engine=vllm"]),
                                      cpu) == "sequence_mask"
    # train.async samples from weights up to max_staleness steps old; staleness 0 is the learner's own weights
    for staleness, mode in ((1, "sequence_mask"), (0, "none")):
        lagged = load_config(None, ["train.async.enabled=true", f"train.async.max_staleness={staleness}"])
        assert resolve_rollout_correction(lagged, cpu) == mode
        assert resolve_rollout_correction(lagged, cuda) == ("sequence_mask" if staleness else "token_tis")
    assert mismatch_kinds(load_config(None, ["train.async.enabled=true"]), cuda) == ("staleness", "precision")
    explicit = load_config(None, ["algo.rollout_correction=token_tis", "rollout.engine=vllm"])
    assert resolve_rollout_correction(explicit, cpu) == "token_tis"
    assert resolve_rollout_correction(load_config(None, ["algo.rollout_correction=none", "rollout.engine=vllm"]),
                                      cpu) == "none"


@pytest.mark.parametrize("overrides, warned", [
    (["algo.rollout_correction=none", "train.async.enabled=true", "train.async.max_staleness=2"], True),
    (["algo.rollout_correction=none", "train.async.enabled=true", "optim.epochs=2"], False),  # clipped vs sampler
    (["algo.rollout_correction=none", "train.async.enabled=true", "optim.mini_batches=2"], False),
    (["algo.rollout_correction=none", "train.async.enabled=true", "train.async.max_staleness=0"], False),
    (["train.async.enabled=true"], False),  # auto: TRL's default weighs the stale batches
    (["algo.rollout_correction=none"], False),  # synchronous: nothing stale
])
def test_stale_batches_without_correction_or_clipping_are_warned_about(overrides, warned):
    message = uncorrected_staleness(load_config(None, overrides))
    assert (message is not None) == warned
    if warned:
        assert message.startswith("algo.rollout_correction: none with train.async.max_staleness 2 and one pass")
        assert "Set algo.rollout_correction: auto" in message and "optim.epochs" in message


def test_the_updater_logs_the_warning_and_the_mismatch_kinds(caplog):
    overrides = ["algo.rollout_correction=none", "train.async.enabled=true", "model.compute_dtype=bfloat16"]
    with caplog.at_level(logging.INFO, logger="podsrl"):
        make_updater(tiny_model(), True, *overrides)
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["update: " + uncorrected_staleness(load_config(None, overrides))]
    assert any(r.message.endswith("(algo.rollout_correction: none; sampler/trainer mismatch: staleness, precision)")
               for r in caplog.records)


def test_trl_names_map_to_the_keys():
    cfg = load_config(None, ["vllm_importance_sampling_mode=token_truncate", "vllm_importance_sampling_clip_max=2.0",
                             "vllm_importance_sampling_clip_min=0.5"])
    assert (cfg.algo.rollout_correction, cfg.algo.rollout_correction_cap, cfg.algo.rollout_correction_cap_low) == (
        "token_tis", 2.0, 0.5)


# ---- real samplers on the built-in tiny model ----

TEMPERATURE = 0.8


def sample(engine_cls, sampler_model, trainer_model, tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trainer log-probs, sampler log-probs, mask) of 64 rollouts sampled by `sampler_model`."""
    prompts = [tokenizer("12+34=", add_special_tokens=False).input_ids,
               tokenizer("7+5=", add_special_tokens=False).input_ids]
    engine = engine_cls(sampler_model, tokenizer)
    out = engine.generate(prompts, [32, 32], SamplingParams(max_new_tokens=12, temperature=TEMPERATURE),
                          torch.arange(64))
    batch = RolloutBatch(
        problems=[Problem(uid=str(i), prompt="", answer="") for i in range(2)], group_index=out.group_index,
        prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
        completion_mask=out.completion_mask.float(), truncated=out.truncated, sampler_logprobs=out.logprobs)
    width = int(batch.completion_mask.sum(dim=1).max())
    with torch.no_grad():
        trainer, _ = plain_logprobs(trainer_model, batch, torch.arange(64), width, torch.device("cpu"), TEMPERATURE,
                                    1024)
    mask = batch.completion_mask[:, :width]
    return trainer * mask, out.logprobs[:, :width], mask


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(TinyModelConfig(), tokenizer, seed=0).eval(), tokenizer


# Measured on this CPU (one thread): max |ratio - 1| = 9.5e-7 (fast engine, 760 tokens) and 1.4e-6 (hf engine, 717
# tokens): the sampler's incremental KV-cache decode and the trainer's full-sequence forward sum the same float32
# products in other orders, a few ulps (float32 eps 1.2e-7) of the logits. 1e-5 leaves 7x margin over the worst for
# other BLAS kernels and thread counts, and stays 1,000x below the bf16 sampler's gap measured below (1.0e-2).
SAME_PRECISION_BOUND = 1e-5


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
def test_the_trainers_own_fp32_module_gives_ratios_within_float_rounding_of_one(tiny, engine_cls):
    model, tokenizer = tiny
    trainer, sampler, mask = sample(engine_cls, model, model, tokenizer)
    ratio = torch.exp(trainer - sampler)[mask > 0]
    print(f"{engine_cls.__name__}: max |ratio - 1| = {float((ratio - 1).abs().max()):.2e} over {ratio.numel()} "
          "tokens")
    assert float((ratio - 1).abs().max()) <= SAME_PRECISION_BOUND
    for mode in ("token_tis", "sequence_mask"):
        out = rollout_correction(trainer, sampler, mask, mode, 3.0)
        # a sequence ratio multiplies up to 12 token ratios: within 12x the token bound
        bound = SAME_PRECISION_BOUND * (1 if mode == "token_tis" else 12)
        assert float(((out.weight - 1) * mask).abs().max()) <= bound
        assert bool(out.keep[mask > 0].all())


def test_a_bf16_sampler_gives_ratios_away_from_one_weighted_per_the_formula(tiny):
    model, tokenizer = tiny
    sampler_model = copy.deepcopy(model).to(torch.bfloat16)
    trainer, sampler, mask = sample(FastEngine, sampler_model, model, tokenizer)
    ratio = torch.exp(trainer - sampler)
    gap = float(((ratio - 1) * mask).abs().max())
    print(f"bf16 sampler, fp32 trainer: max |ratio - 1| = {gap:.3f}")
    assert gap > 100 * SAME_PRECISION_BOUND
    cap = float(ratio[mask > 0].median())  # a cap that truncates about half of the tokens
    out = rollout_correction(trainer, sampler, mask, "token_tis", cap)
    torch.testing.assert_close(out.weight, torch.exp(trainer - sampler).clamp(max=cap) * mask)
    assert 0.3 < out.metric_values()["sampling/importance_sampling_ratio/clipped_fraction"] < 0.7
    seq = torch.exp(((trainer - sampler) * mask).sum(dim=1))
    out = rollout_correction(trainer, sampler, mask, "sequence_mask", 1.0 + gap / 4, 1.0 - gap / 4)
    outside = (seq > 1.0 + gap / 4) | (seq < 1.0 - gap / 4)
    assert bool(outside.any()) and not bool(outside.all())
    torch.testing.assert_close(out.weight, torch.where(outside, 0.0, seq)[:, None] * mask)
