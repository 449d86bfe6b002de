"""update.activation_checkpointing: the same gradients as without it on the shared-prompt and plain paths (LoRA
too), each decoder layer run twice per backward (and once without gradients: old/reference log-probs, generation),
and fewer activations kept for the backward."""

from __future__ import annotations

import functools

import pytest
import torch

from podsrl.config import load_config
from podsrl.lora import apply_lora
from podsrl.models.transformers_api import base_model
from tests.update.test_shared_prompt import grads, hf_model, make_batch, make_updater, rel, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# Recomputing a layer replays the same float32 operations on the same inputs; any difference would be a reordering,
# so 1e-5 (the project's float32 path-equality bound) is loose.
TOL = 1e-5
MODELS = {
    "tiny": (tiny_model, 128),
    "qwen2": (functools.partial(hf_model, "qwen2", vocab=300, hidden=64, layers=3), 300),
    "qwen2_lora": (lambda: apply_lora(hf_model("qwen2", vocab=300, hidden=64, layers=3), rank=4,
                                      target_modules="all-linear"), 300),
}


def count_layer_runs(model) -> list[int]:
    """A one-element counter of decoder layer runs: each layer's o_proj is called once per run of the layer, in
    both paths (the shared-prompt path calls the module; hooks on the layer itself are outside transformers'
    checkpoint)."""
    runs = [0]
    for layer in base_model(model).model.layers:
        layer.self_attn.o_proj.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs


def update(kind: str, shared: bool, checkpointing: bool, *overrides: str):
    make, vocab = MODELS[kind]
    model = make()
    updater = make_updater(model, shared, "optim.micro_batch_size=20",
                           f"update.activation_checkpointing={str(checkpointing).lower()}", *overrides)
    assert (updater.shared[id(model)] is not None) == shared
    runs = count_layer_runs(model)
    metrics = updater.update(make_batch([4, 1, 3, 2], vocab, seed=1), torch.Generator().manual_seed(5))
    return metrics, grads(model), runs[0], len(base_model(model).model.layers)


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prompt", "plain"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_same_gradients_and_each_layer_recomputed(kind, shared):
    m0, g0, runs0, layers = update(kind, shared, False)
    m1, g1, runs1, _ = update(kind, shared, True)
    assert rel(g1, g0) <= TOL, rel(g1, g0)
    assert abs(m1["loss"] - m0["loss"]) <= TOL * max(1.0, abs(m0["loss"]))
    assert g0.abs().sum() > 0
    # one micro-batch, one pass: each layer runs once without checkpointing, twice with it (forward + recompute)
    assert (runs0, runs1) == (layers, 2 * layers)


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prompt", "plain"])
def test_no_recompute_without_gradients(shared):
    """Old-policy log-probs (two passes) are computed under no_grad: one run per layer, none replayed."""
    make, vocab = MODELS["qwen2"]
    model = make()
    updater = make_updater(model, shared, "optim.micro_batch_size=20", "update.activation_checkpointing=true")
    runs = count_layer_runs(model)
    model.train()
    updater._precompute(model, make_batch([4, 1, 3, 2], vocab, seed=1))
    assert runs[0] == len(base_model(model).model.layers)


def test_generation_unaffected():
    """The plain path leaves transformers' checkpointing on; a model in training mode generating without gradients
    (the hf engine's case) keeps its KV cache and its tokens."""
    make, vocab = MODELS["qwen2"]
    plain, checkpointed = make(), make()
    make_updater(checkpointed, False, "update.activation_checkpointing=true")
    prompt = torch.randint(3, vocab, (2, 5), generator=torch.Generator().manual_seed(0))
    out = []
    for model in (plain, checkpointed):
        model.train()
        runs = count_layer_runs(model)
        with torch.no_grad():
            out.append(model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0))
        assert runs[0] == 6 * len(base_model(model).model.layers)  # one run per layer and token: cache kept
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prompt", "plain"])
def test_fewer_activations_saved(shared):
    """Bytes autograd keeps for the backward after the forward of one micro-batch: with checkpointing each layer
    keeps its inputs only (what checkpoint saves is invisible to an outer saved-tensor hook, but the layer's
    input is also saved outside it by the previous layer's ops)."""
    make, vocab = MODELS["qwen2"]
    batch = make_batch([4, 1, 3, 2], vocab, seed=1)
    saved = {}
    for checkpointing in (False, True):
        model = make()
        updater = make_updater(model, shared, "optim.micro_batch_size=20",
                               f"update.activation_checkpointing={str(checkpointing).lower()}")
        model.train()
        total = [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            (logp, _), _ = updater._forward(model, batch, torch.arange(batch.num_rollouts))
        saved[checkpointing] = total[0]
        logp.sum().backward()
    assert saved[True] < 0.5 * saved[False], saved


def test_trl_names_are_aliases():
    cfg = load_config(None, ["gradient_checkpointing=true", "bf16=true"])
    assert cfg.update.activation_checkpointing is True and cfg.model.compute_dtype == "bfloat16"
    assert load_config(None, ["bf16=false"]).model.compute_dtype == "float32"
