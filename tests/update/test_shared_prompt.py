"""The shared-prompt update path equals the plain reference path: loss, metrics, gradients and the weights after
whole updates, on the built-in tiny model, ~10M-parameter Qwen2 and Llama models with a 32k vocabulary and a small
Qwen3, for unequal groups and lengths, LoRA, a KL reference model, several passes/mini-batches and DynaMO's token
modulation; a short training run logs the same metrics either way."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from podsrl.algo.modulation import dynamo_modulation
from podsrl.batch import Problem, RolloutBatch
from podsrl.config import TinyModelConfig, load_config
from podsrl.config.facts import run_facts
from podsrl.memory_plan import AUTO_MICRO_BATCH_CPU
from podsrl.methods.dynamo import DynamoConfig
from podsrl.models import packed_layout
from podsrl.models.loading import build_char_tokenizer, build_tiny_model
from podsrl.models.packed import packed_forward_problem
from podsrl.models.packed_layout import build_plan, distinct_rows
from podsrl.reporting.tracking import read_metrics
from podsrl.run.trainer import Trainer
from podsrl.update import PolicyUpdater, UpdateSettings
from tests.conftest import device_under_test, tiny_overrides

TOL = 1e-5


def hf_model(kind: str, vocab: int = 32000, hidden: int = 256, layers: int = 2, seed: int = 0):
    """Random-init model built from a config (~10M parameters at the defaults, tied embeddings)."""
    common = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1}  # fmt: skip
    cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    torch.manual_seed(seed)
    return cls[1](cls[0](**common))


def tiny_model():
    return build_tiny_model(TinyModelConfig(), build_char_tokenizer(), seed=0)


def make_batch(sizes: list[int], vocab: int, seed: int = 0, max_prompt: int = 9, max_len: int = 12) -> RolloutBatch:
    """Groups of unequal sizes, prompts of unequal lengths (left-padded), completions of 1..max_len tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    group = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    prompt_ids = torch.zeros(rows, max_prompt, dtype=torch.long)
    prompt_mask = torch.zeros(rows, max_prompt, dtype=torch.long)
    for g in range(len(sizes)):
        length = int(torch.randint(2, max_prompt + 1, (1,), generator=gen))
        tokens = torch.randint(3, vocab, (length,), generator=gen)
        prompt_ids[group == g, max_prompt - length:] = tokens
        prompt_mask[group == g, max_prompt - length:] = 1
    lengths = torch.randint(1, max_len + 1, (rows,), generator=gen)
    lengths[0] = max_len
    completion_mask = (torch.arange(max_len) < lengths[:, None]).float()
    completion_ids = torch.randint(3, vocab, (rows, max_len), generator=gen) * completion_mask.long()
    return RolloutBatch(
        problems=[Problem(uid=str(g), prompt="", answer="") for g in range(len(sizes))],
        group_index=group, prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, truncated=torch.zeros(rows, dtype=torch.bool),
        advantages=torch.randn(rows, generator=gen),
    )


def make_updater(model, shared: bool, *overrides: str, ref=None, modulation=None) -> PolicyUpdater:
    # float32 compute on every device unless a test sets the precision (`auto` is bfloat16 on CUDA): the two paths
    # are compared at float32 tolerance
    precision = [] if any(o.startswith(("model.dtype=", "model.compute_dtype=")) for o in overrides) else [
        "model.compute_dtype=float32"]
    cfg = load_config(None, [f"update.shared_prompt={str(shared).lower()}", "update.logits_chunk=7",
                             "rollout.max_new_tokens=12", "rollout.temperature=0.8", *precision,
                             # optim.micro_batch_size=auto as a CPU run decides it, on every device (an override wins)
                             f"optim.micro_batch_size={AUTO_MICRO_BATCH_CPU}", *overrides])
    device = device_under_test()
    model.to(device)  # in place: the caller's model is the one updated
    if ref is not None:
        ref.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)  # no Adam: its normalisation would amplify rounding noise
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg), run_facts(cfg, device), ref, modulation)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad and p.grad is not None])


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def compare(make_model, batch: RolloutBatch, *overrides: str, ref=None, modulation=None, tol: float = TOL) -> dict:
    """Whole updates on two copies of a model, shared vs plain: metrics, last mini-batch's gradients, weights."""
    out = {}
    for shared in (True, False):
        model = make_model()
        updater = make_updater(model, shared, *overrides, ref=ref, modulation=modulation)  # moves it to the device
        start = weights(model).clone()
        assert (id(model) in updater.shared and updater.shared[id(model)] is not None) == shared
        metrics = updater.update(batch, torch.Generator().manual_seed(5))
        out[shared] = (metrics, grads(model), weights(model) - start)
    (m1, g1, w1), (m0, g0, w0) = out[True], out[False]
    assert m1.keys() == m0.keys()
    for k in m0:
        assert abs(m1[k] - m0[k]) <= tol * max(1.0, abs(m0[k])), (k, m1[k], m0[k])
    assert rel(g1, g0) <= tol, rel(g1, g0)
    print(f"gradient rel. error {rel(g1, g0):.2e}, weight-change rel. error {rel(w1, w0):.2e}")
    # weight changes are differences of float32 weights (the norms' are near 1): rounded at ~1e-7 absolute
    assert rel(w1, w0) <= 10 * tol
    assert g0.abs().sum() > 0
    return m0


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["tiny", "qwen2", "llama", "qwen3"])
def test_equals_plain_path(kind):
    if kind == "tiny":
        make, vocab = tiny_model, 128
    elif kind == "qwen3":
        make, vocab = functools.partial(hf_model, "qwen3", vocab=300, hidden=64), 300
    else:
        make, vocab = functools.partial(hf_model, kind), 32000
    batch = make_batch([4, 1, 3, 2], vocab, seed=1)
    compare(make, batch, "optim.micro_batch_size=4")


def test_long_unequal_completions_in_several_length_buckets():
    batch = make_batch([7, 5], 300, seed=8, max_len=150)
    plan = build_plan(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                      torch.device("cpu"))
    assert len(plan.buckets) >= 2
    compare(functools.partial(hf_model, "llama", vocab=300, hidden=64), batch, "rollout.max_new_tokens=150")


def test_several_passes_mini_batches_and_kl():
    ref = tiny_model()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = make_batch([5, 2, 1, 4, 3], 128, seed=2)
    metrics = compare(tiny_model, batch, "optim.epochs=2", "optim.mini_batches=2", "optim.micro_batch_size=3",
                      "algo.beta=0.1", "algo.loss_agg=seq_mean_token_mean", ref=ref)
    assert metrics["kl"] > 0


def test_modulation():
    """DynaMO's factor amplifies float32 rounding ~50x (its sigmoid has slope ~5 at the micro-batch's largest
    entropy change): the plain path against itself with one extra left-padding column differs by 1.2e-5 on this
    batch. So the 1e-5 check runs in float64, and float32 is held to 1e-4."""
    d = DynamoConfig()
    modulation = functools.partial(dynamo_modulation, epsilon_low=0.2, epsilon_high=0.28, lambda_min=d.lambda_min,
                                   gamma=d.gamma, tau=d.tau, mu_max=d.mu_max, stabilize=True, compensate=True)
    batch = make_batch([6, 3, 2], 128, seed=3)
    metrics = compare(lambda: tiny_model().double(), batch, "optim.micro_batch_size=5", modulation=modulation)
    assert "modulation/stab_mean" in metrics
    compare(tiny_model, batch, "optim.micro_batch_size=5", modulation=modulation, tol=1e-4)


def test_lora():
    from podsrl.lora import apply_lora

    batch = make_batch([3, 4, 2], 32000, seed=4)
    compare(lambda: apply_lora(hf_model("qwen2"), rank=4, target_modules="all-linear"), batch,
            "optim.micro_batch_size=5")


def test_plan_shares_prompts_and_skips_padding():
    batch = make_batch([4, 1, 3], 128, seed=5)
    rows = torch.arange(batch.num_rollouts)
    plan = build_plan(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                      torch.device("cpu"))
    prompt_tokens = sum(int(batch.prompt_mask[batch.group_index == g][0].sum()) for g in range(3))
    completion_inputs = int((batch.completion_mask.sum(1) - 1).sum())
    assert plan.ids.numel() == prompt_tokens + completion_inputs  # each prompt once, no padding
    assert plan.targets.numel() == int(batch.completion_mask.sum())
    assert plan.prompt_shape[0] == 3 and rows.numel() == 8
    # a hole in a completion mask or an empty prompt: no plan (the plain path takes that micro-batch)
    holed = batch.completion_mask.clone()
    holed[0, 1] = 0
    assert build_plan(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, holed, torch.device("cpu")) is None
    empty = batch.prompt_mask.clone()
    empty[0] = 0
    assert build_plan(batch.prompt_ids, empty, batch.completion_ids, batch.completion_mask,
                      torch.device("cpu")) is None


@pytest.mark.parametrize("collide", [False, True])
def test_distinct_rows_are_torch_unique_up_to_order(monkeypatch, collide):
    """The plan's prompt deduplication: the same rows and grouping as torch.unique(dim=0); with every hash equal
    (a forced collision) the row check sends it to torch.unique itself."""
    if collide:
        monkeypatch.setattr(packed_layout, "_hash_weights", lambda width: torch.zeros(width, dtype=torch.long))
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        width = int(torch.randint(1, 12, (1,), generator=gen))
        prompts = torch.randint(-1, 5, (int(torch.randint(1, 6, (1,), generator=gen)), width), generator=gen)
        rows = prompts[torch.randint(0, len(prompts), (int(torch.randint(1, 40, (1,), generator=gen)),),
                                     generator=gen)]
        distinct, inverse = distinct_rows(rows)
        expected, _ = torch.unique(rows, dim=0, return_inverse=True)
        assert torch.equal(distinct[inverse], rows)
        assert sorted(map(tuple, distinct.tolist())) == sorted(map(tuple, expected.tolist()))


def test_other_architectures_fall_back_with_one_log_line(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in packed_forward_problem(model)
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        updater = make_updater(model, True)
    assert updater.shared[id(model)] is None
    assert sum("plain path" in r.message for r in caplog.records) == 1
    batch = make_batch([2, 2], 50, seed=6)
    metrics = updater.update(batch, torch.Generator().manual_seed(0))
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_training_run_matches_plain_path(tmp_path, warmup_cache):
    records = {}
    for shared in (True, False):
        overrides = tiny_overrides(tmp_path / str(shared), warmup_cache, **{
            "update.shared_prompt": str(shared).lower(), "train.max_steps": 3, "optim.mini_batches": 2,
            "rollout.n": 8, "method": "pods", "pods.m": 4})
        Trainer(load_config(None, overrides)).train()
        records[shared] = [r for r in read_metrics(tmp_path / str(shared) / "metrics.jsonl") if "loss" in r]
    assert len(records[True]) == len(records[False]) == 3
    for a, b in zip(records[True], records[False]):
        for k in ("loss", "entropy", "grad_norm", "reward", "clip_ratio/region_mean"):
            if k in b:
                assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(b[k])), (k, a[k], b[k])


def test_copy_of_updater_inputs_untouched():
    """The shared path reads the batch without modifying it (the plain path may run on it after)."""
    batch = make_batch([3, 2], 128, seed=7)
    before = copy.deepcopy(batch)
    make_updater(tiny_model(), True).update(batch, torch.Generator().manual_seed(0))
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"):
        assert torch.equal(getattr(batch, name), getattr(before, name))
