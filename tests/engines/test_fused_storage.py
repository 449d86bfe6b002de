"""The fast engine's own weights copy (weights_dtype) keeps each layer's q/k/v and gate/up projections as views of one
tensor, which the decode step uses as its fused weights: no concatenated second copy, the very same tokens and
log-probs as with one, and weight syncs reach it through the kept binding (where refresh_fused copies nothing)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters

from podsrl.engines import SamplingParams
from podsrl.engines import fast as fast_module
from podsrl.engines.decode_step import Buckets, StepRunner
from podsrl.engines.fast import FastEngine
from tests.engines.graph_stand_in import RecordedGraphs
from tests.engines.test_decode_graph import on_cpu
from tests.engines.test_engines import make_model, random_prompts
from tests.tiny_lm import TokStub as Tok

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS, COUNTS, SEEDS = random_prompts([3, 8, 5]), [3, 2, 4], torch.arange(9) * 31
SAMPLED = SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9)
GREEDY = SamplingParams(max_new_tokens=9, temperature=1e-5)


def storages(tensors) -> dict[int, int]:
    """Distinct storages among the tensors: address -> bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def plan_tensors(engine: FastEngine) -> list[torch.Tensor]:
    out = []
    for plan in engine.forward.plans:
        out += [t for t in (*(plan.qkv or ()), plan.gate_up) if t is not None]
    return out


def separate_copy(model) -> FastEngine:
    """The engine as it was before: its copy's projections as separate tensors, the fused weights concatenated."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_module, "share_fused_weights", lambda model: None)
        return FastEngine(model, Tok(), weights_dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", ["qwen", "llama"])  # Qwen2 has q/k/v biases, Llama none
def test_the_fused_weights_are_the_copys_own_storage_and_change_no_token(kind):
    model = make_model(kind, peak=3.0, eos_bias=2.0)
    shared, separate = FastEngine(model, Tok(), weights_dtype=torch.bfloat16), separate_copy(model)
    for params in (GREEDY, SAMPLED):
        a = shared.generate(PROMPTS, COUNTS, params, SEEDS)
        b = separate.generate(PROMPTS, COUNTS, params, SEEDS)
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert len(shared.forward.plans) == model.config.num_hidden_layers
    for plan, layer in zip(shared.forward.plans, shared.forward.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert plan.qkv[0].data_ptr() == attn.q_proj.weight.data_ptr()
        assert torch.equal(plan.qkv[0], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        if kind == "qwen":
            assert plan.qkv[1].data_ptr() == attn.q_proj.bias.data_ptr()
            assert torch.equal(plan.qkv[1], torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        assert plan.gate_up.data_ptr() == mlp.gate_proj.weight.data_ptr()
        assert torch.equal(plan.gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    # what the copy and its plans hold together is the copy alone; before, the plans added their own storages
    copy_bytes = sum(storages(shared.model.parameters()).values())
    assert sum(storages([*shared.model.parameters(), *plan_tensors(shared)]).values()) == copy_bytes
    separate_bytes = sum(storages(separate.model.parameters()).values())
    assert separate_bytes == copy_bytes
    fused_bytes = sum(t.nbytes for t in plan_tensors(separate))
    assert sum(storages([*separate.model.parameters(), *plan_tensors(separate)]).values()) == copy_bytes + fused_bytes


def test_a_weight_sync_reaches_the_shared_fused_weights():
    """Every projection of the policy changes; after sync_weights the engine (its step binding kept, so the fused
    weights are refreshed, not rebuilt) samples what an engine built from the updated policy samples, to the bit."""
    model = make_model("qwen", peak=3.0, eos_bias=2.0)
    engine = FastEngine(model, Tok(), weights_dtype=torch.bfloat16)
    old = engine.generate(PROMPTS, COUNTS, SAMPLED, SEEDS)
    binding = engine.forward.binding
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g).to(p.device))
    engine.sync_weights(model)
    new = engine.generate(PROMPTS, COUNTS, SAMPLED, SEEDS)
    assert engine.forward.binding == binding  # refreshed in place, not bound anew
    fresh = separate_copy(model).generate(PROMPTS, COUNTS, SAMPLED, SEEDS)
    assert torch.equal(new.completion_ids, fresh.completion_ids) and torch.equal(new.logprobs, fresh.logprobs)
    assert not torch.equal(new.logprobs, old.logprobs)


def test_lora_wrapped_projections_stay_apart_and_the_rest_is_shared():
    """LoRA on q and v: q/k/v run one by one (not fused, left as they are); gate/up still share one tensor."""
    model = get_peft_model(make_model("qwen", peak=3.0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a non-zero adapter, so that it matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    shared, separate = FastEngine(model, Tok(), weights_dtype=torch.bfloat16), separate_copy(model)
    a = shared.generate(PROMPTS, COUNTS, SAMPLED, SEEDS)
    b = separate.generate(PROMPTS, COUNTS, SAMPLED, SEEDS)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    for plan, layer in zip(shared.forward.plans, shared.forward.layers):
        assert plan.qkv is None
        assert plan.gate_up.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()


@on_cpu
def test_captured_steps_read_the_synced_weights_and_dynamo_compiles_once_per_bucket():
    """Under the decode step's graphs (the CPU stand-in for CUDA graph capture and replay: each replay runs the
    captured step's objects) the shared fused weights are what a replay reads, so a sync alone moves the samples;
    under dynamo (fullgraph, no codegen) the aliasing views add no recompilation: one graph per bucket visited."""
    model = make_model("qwen", peak=3.0, eos_bias=2.0)
    engine = FastEngine(model, Tok(), weights_dtype=torch.bfloat16)
    engine.runner, engine.buckets = StepRunner(), Buckets(block=4)
    engine.runner.graphs = RecordedGraphs()
    first = engine.generate(PROMPTS, COUNTS, SAMPLED, SEEDS)
    captured = len(engine.runner.graphs.graphs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(1.2)
    engine.sync_weights(model)
    replayed = engine.generate(PROMPTS, COUNTS, SAMPLED, SEEDS)
    fresh = separate_copy(model).generate(PROMPTS, COUNTS, SAMPLED, SEEDS)
    assert torch.equal(replayed.completion_ids, fresh.completion_ids) and torch.equal(replayed.logprobs, fresh.logprobs)
    assert not torch.equal(replayed.logprobs, first.logprobs) and captured > 0

    torch._dynamo.reset()
    counters.clear()
    compiled = FastEngine(model, Tok(), weights_dtype=torch.bfloat16, compile="eager", cache_block=4)
    out = compiled.generate(PROMPTS, COUNTS, SAMPLED, SEEDS)
    assert torch.equal(out.completion_ids, fresh.completion_ids) and torch.equal(out.logprobs, fresh.logprobs)
    assert counters["stats"]["unique_graphs"] == len(compiled.runner.visited)
