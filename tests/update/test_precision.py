"""Mixed precision (model.compute_dtype): the dtype resolution and its refusals, the update under bfloat16 autocast
against float32 on both paths, float32 log-prob statistics under autocast, and a bfloat16-compute run that learns
and checkpoints float32 master weights and optimiser state."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from podsrl.config import load_config
from podsrl.config.facts import run_facts
from podsrl.errors import ConfigError
from podsrl.models.logprobs import head_logprobs_and_entropy
from podsrl.models.precision import compute_autocast, describe_precision, resolve_compute_dtype
from podsrl.reporting.tracking import read_metrics
from podsrl.run.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.tiny_lm import TokStub as Tok
from tests.tiny_lm import tiny_causal_lm
from tests.update.test_shared_prompt import grads, hf_model, make_batch, make_updater, rel, tiny_model

FIXTURES = Path(__file__).parents[1] / "fixtures"

pytestmark = pytest.mark.usefixtures("one_thread")


def config(*overrides: str):
    return load_config(None, list(overrides))


def test_auto_is_bfloat16_on_cuda_float32_on_cpu_never_wider_than_the_weights():
    auto = config()
    assert resolve_compute_dtype(auto, "cpu") == torch.float32
    assert resolve_compute_dtype(auto, torch.device("cuda")) == torch.bfloat16
    pure = config("model.dtype=bfloat16")
    assert resolve_compute_dtype(pure, "cpu") == torch.bfloat16
    assert resolve_compute_dtype(config("model.compute_dtype=bfloat16"), "cpu") == torch.bfloat16
    assert resolve_compute_dtype(config("model.compute_dtype=float32"), "cuda") == torch.float32
    assert describe_precision(torch.bfloat16, torch.bfloat16).startswith(
        "pure bfloat16: weights and optimiser state in bfloat16")
    assert describe_precision(torch.float32, torch.bfloat16).startswith("mixed precision")
    assert describe_precision(torch.float32, torch.float32).startswith("float32")
    # the presets' LoRA over a bfloat16 base: the adapters and their AdamW state are float32, not "pure bfloat16"
    assert describe_precision(torch.bfloat16, torch.bfloat16, lora=True) == (
        "LoRA: float32 adapters and their optimiser state over a frozen bfloat16 base (no float32 master copy of it); "
        "matmuls in bfloat16, the adapters' in float32")


@pytest.mark.parametrize("overrides, words", [
    (["model.dtype=bfloat16", "model.compute_dtype=float32"], "gains nothing"),
    (["model.compute_dtype=float16"], "no loss scaling"),
    (["model.compute_dtype=bfloat16", "train.strategy=fsdp", "train.fsdp_param_dtype=float32"], "same setting"),
])
def test_nonsense_combinations_are_refused_naming_the_key(overrides, words):
    with pytest.raises(ConfigError, match=f"(model.compute_dtype|train.fsdp_param_dtype): .*{words}"):
        load_config(None, overrides)


def test_under_fsdp_either_explicit_dtype_is_the_compute_dtype_and_the_config_stays_as_given():
    for given in ("model.compute_dtype", "train.fsdp_param_dtype"):
        cfg = load_config(None, [f"{given}=bfloat16", "train.strategy=fsdp"])
        assert (cfg.model.compute_dtype, cfg.train.fsdp_param_dtype).count("auto") == 1  # nothing filled in
        assert resolve_compute_dtype(cfg, "cpu") == torch.bfloat16


def test_autocast_is_a_no_op_when_compute_is_the_parameter_dtype():
    with compute_autocast("cpu", torch.float32, torch.float32):
        assert not torch.is_autocast_enabled("cpu")
    with compute_autocast("cpu", torch.bfloat16, torch.float32):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_log_prob_statistics_stay_float32_under_autocast():
    """Only the output layer's matmul runs in bfloat16: from the same bfloat16 logits, log-probs and entropy equal a
    float64 computation to float32 rounding (on the CPU autocast would otherwise run the entropy's einsum in
    bfloat16, an error of ~1e-2 relative), and their gradients reach the float32 parameters in float32."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 48, generator=gen, requires_grad=True)
    weight = (0.3 * torch.randn(500, 48, generator=gen)).requires_grad_()
    tokens = torch.randint(0, 500, (37,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = head_logprobs_and_entropy(hidden, weight, None, tokens, 0.7, chunk=8)
    assert logp.dtype == entropy.dtype == torch.float32
    logits = torch.nn.functional.linear(hidden.detach().bfloat16(), weight.detach().bfloat16()).double() / 0.7
    ref_logp = torch.log_softmax(logits, -1)
    assert float((logp.detach().double() - ref_logp.gather(1, tokens[:, None])[:, 0]).abs().max()) < 1e-5
    ref_entropy = -(ref_logp.exp() * ref_logp).sum(-1)
    assert float(((entropy.detach().double() - ref_entropy).abs() / ref_entropy).max()) < 1e-5
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32


def _update(make_model, batch, shared: bool, compute: str):
    """One update (KL to a perturbed reference, so the loss depends on the log-probs' values): loss, KL, grads."""
    model, ref = make_model(), make_model()
    torch.manual_seed(11)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # no rollout correction (auto turns it on for bf16 compute): the synthetic batch has no sampler, and the
    # comparison is of the autocast alone
    updater = make_updater(model, shared, "optim.micro_batch_size=4", f"model.compute_dtype={compute}",
                           "algo.beta=0.1", "algo.rollout_correction=none", ref=ref)
    metrics = updater.update(batch, torch.Generator().manual_seed(5))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return metrics["loss"], metrics["kl"], grads(model)


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prompt", "plain"])
@pytest.mark.parametrize("kind", ["tiny", "qwen2"])
def test_bfloat16_autocast_loss_and_gradients_near_float32(kind, shared):
    """bfloat16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3) in every matmul input. Measured on these
    batches (seeds 0-2, both paths, both models): loss rel. error <= 7.6e-4, KL <= 5.8e-3, gradient rel. error
    (norm of the difference / norm) 7.0e-3 to 8.9e-3. Bounds: loss 5e-3, KL 2e-2, gradients 2e-2 (10 unit
    roundoffs, ~2x the worst measured). The gradients must also differ by > 1e-3 (float32 rounding alone gives
    ~1e-6), so an autocast that never engages fails."""
    if kind == "tiny":
        make, vocab = tiny_model, 128
    else:
        make, vocab = functools.partial(hf_model, "qwen2"), 32000
    batch = make_batch([4, 1, 3, 2], vocab, seed=1)
    loss32, kl32, g32 = _update(make, batch, shared, "float32")
    loss16, kl16, g16 = _update(make, batch, shared, "bfloat16")
    assert abs(loss16 - loss32) <= 5e-3 * abs(loss32), (loss16, loss32)
    assert abs(kl16 - kl32) <= 2e-2 * abs(kl32), (kl16, kl32)
    assert 1e-3 < rel(g16, g32) <= 2e-2, rel(g16, g32)


def test_bfloat16_compute_run_learns_and_checkpoints_float32_masters(tmp_path, warmup_cache, caplog):
    """The learnable-reward run of tests/run/test_trainer.py (a random tiny model must raise the share of '1'
    characters it writes) with bfloat16 compute: it learns as the float32 run does, and its checkpoint holds the
    float32 parameters and AdamW state, not a bfloat16 copy."""
    run = tmp_path / "run"
    overrides = tiny_overrides(run, warmup_cache, **{
        "warmup.steps": 0, "train.max_steps": 30, "optim.lr": 3e-3, "rollout.prompts_per_step": 8,
        "rollout.n": 8, "rollout.max_new_tokens": 6, "rewards": f"[{FIXTURES / 'rewards_ones.py'}:ones_share]",
        "train.eval_every": 30, "model.compute_dtype": "bfloat16"})
    with caplog.at_level(logging.INFO, logger="podsrl"):
        Trainer(load_config("podsrl/configs/grpo.yaml", overrides)).train()
    assert any("mixed precision: float32 master weights" in r.message for r in caplog.records)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward" in r]
    assert len(steps) == 30 and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    rewards = [r["reward"] for r in steps]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, (first, last)
    checkpoint = max((run / "checkpoints").iterdir())
    weights = load_file(str(next((checkpoint / "model").glob("*.safetensors"))))
    assert weights and all(t.dtype == torch.float32 for t in weights.values())
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    moments = [t for s in state["optimizer"]["state"].values() for k, t in s.items() if k.startswith("exp_avg")]
    assert moments and all(t.dtype == torch.float32 for t in moments)


def test_pure_bfloat16_is_named_and_runs_without_autocast(caplog):
    """model.dtype=bfloat16: the weights themselves train in bfloat16 (no autocast, nothing to cast), and the log
    says so."""
    model = tiny_model().to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="podsrl"):
        updater = make_updater(model, True, "model.dtype=bfloat16", "optim.micro_batch_size=4")
    assert updater.compute_dtype == updater.param_dtype == torch.bfloat16
    assert any("pure bfloat16: weights and optimiser state in bfloat16" in r.message for r in caplog.records)
    metrics = updater.update(make_batch([4, 1, 3, 2], 128, seed=1), torch.Generator().manual_seed(5))
    assert torch.isfinite(torch.tensor(metrics["loss"])) and grads(model).abs().sum() > 0
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize(("compute", "expected"), [("bfloat16", torch.bfloat16), ("float32", None)])
def test_run_engine_samples_in_the_compute_dtype(compute, expected):
    """build.rollout_engine gives the fast engine a copy in model.compute_dtype when it is narrower than the
    parameters (bf16 sampling of fp32 masters), and none when they agree; an explicit weights_dtype wins."""
    from podsrl.build import rollout_engine

    model = tiny_causal_lm(32)
    cfg = load_config(overrides=[f"model.compute_dtype={compute}"])
    engine = rollout_engine(cfg, model, Tok(), run_facts(cfg, torch.device("cpu")).compute_dtype)
    if expected is None:
        assert engine.copy is None
    else:
        assert {p.dtype for p in engine.copy.parameters()} == {expected}
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters stay float32
    explicit = load_config(overrides=["model.compute_dtype=bfloat16", "rollout.engine_options.weights_dtype=null"])
    assert rollout_engine(explicit, model, Tok(), torch.bfloat16).copy is None
