"""Rollout engines: greedy equality with generate, sampling distribution, log-probs, seeds, stops, compaction."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import transformers
from transformers import Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from podsrl.engines import SamplingParams, build_engine, check_engine_options
from podsrl.engines.fast import FastEngine
from podsrl.engines.hf import HFEngine
from podsrl.engines.sampling import filter_logits, row_uniforms, sample_rows, splitmix64
from podsrl.errors import ConfigError
from podsrl.models.attention import decode_attention, decode_bias, grouped_attention
from podsrl.models.decode import DecodeStack, ModelForward
from podsrl.models.kernels import rotate
from podsrl.models.llama import norm_function
from podsrl.models.transformers_api import FastPathUnavailable
from tests.conftest import device_under_test
from tests.tiny_lm import EOS, PAD, tiny_causal_lm
from tests.tiny_lm import TokStub as Tok

VOCAB = 64
pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(kind: str = "qwen", peak: float = 1.0, eos_bias: float = 0.0, attn: str = "sdpa", seed: int = 0):
    model = tiny_causal_lm(VOCAB, kind=kind, peak=peak, eos_bias=eos_bias, attn=attn, seed=seed)
    return model.to(device_under_test())


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def full_forward_logprobs(model, out, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the completion tokens from one fresh forward pass over prompt + completion."""
    # engine outputs are on the CPU; the model may not be
    ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1).to(model.device)
    mask = torch.cat([out.prompt_mask, out.completion_mask.long()], dim=1).to(model.device)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.cpu()
    lp = out.prompt_ids.shape[1]
    scaled = logits[:, lp - 1 : -1].float() / temperature
    return (
        scaled.log_softmax(-1).gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1) * out.completion_mask
    )


# ---------------------------------------------------------------- sampling helpers


def test_splitmix64_matches_reference():
    def ref(x: int) -> int:
        m = (1 << 64) - 1
        z = (x + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    xs = [0, 1, 2, 12345, 2**62 + 7, -1, -(2**63)]
    got = splitmix64(torch.tensor(xs, dtype=torch.long)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [ref(x & ((1 << 64) - 1)) for x in xs]
    assert ref(0) == 0xE220A8397B1DCDAF  # published first output of splitmix64 seeded with 0


def test_row_uniforms_are_uniform_and_per_row():
    u = row_uniforms(torch.arange(20000), 3)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    assert (hist - 2000).abs().max() < 200  # ~4.7 sigma
    assert torch.equal(row_uniforms(torch.tensor([7, 5]), 3), row_uniforms(torch.tensor([5, 7]), 3).flip(0))
    assert not torch.equal(row_uniforms(torch.arange(5), 3), row_uniforms(torch.arange(5), 4))


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.7), (7, 0.5), (1, 1.0), (0, 0.999)])
def test_filter_logits_matches_transformers_warpers(top_k, top_p):
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(3)) * 2
    logits[0, :4] = 5.0  # ties at the top
    expected = logits
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    assert torch.equal(torch.isinf(filter_logits(logits, top_k, top_p)), torch.isinf(expected))


def test_sample_rows_follows_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]]).repeat(40000, 1)
    tokens, logp = sample_rows(logits, torch.arange(40000), 0, temperature=0.5, top_k=3)
    probs = filter_logits(logits[0] / 0.5, 3, 1.0).softmax(-1)
    freq = torch.bincount(tokens, minlength=5).double() / 40000
    assert torch.all((freq - probs).abs() <= 5 * (probs * (1 - probs) / 40000).sqrt() + 1e-9)
    assert torch.allclose(logp, (logits / 0.5).log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))


# ---------------------------------------------------------------- engines vs generate


@pytest.mark.parametrize("kind,attn", [("qwen", "sdpa"), ("llama", "sdpa"), ("llama", "eager")])
def test_greedy_equals_generate(kind, attn):
    model = make_model(kind, peak=30.0, attn=attn)
    prompts = random_prompts([3, 9, 5, 1, 7])
    counts = [1, 2, 1, 1, 3]
    with torch.no_grad():
        free = model.generate(
            input_ids=torch.tensor([p[-1:] for p in prompts], device=model.device),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=None,
            pad_token_id=PAD,
        )[:, 1:].cpu()
    # stop on a token some free-running greedy rows emit early: varied lengths without an arbitrary EOS bias
    stop = int(torch.mode(free[:, 2:8].flatten()).values)
    params = SamplingParams(max_new_tokens=12, greedy=True, stop_token_ids=(stop,))
    fast = FastEngine(model, Tok()).generate(prompts, counts, params, torch.arange(8))
    hf = HFEngine(model, Tok()).generate(prompts, counts, params, torch.arange(8))
    with torch.no_grad():
        ref = model.generate(
            input_ids=fast.prompt_ids.to(model.device),
            attention_mask=fast.prompt_mask.to(model.device),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=[EOS, stop],
            pad_token_id=PAD,
        )
    ref = ref[:, fast.prompt_ids.shape[1] :].cpu()
    assert torch.equal(fast.completion_ids, ref) and torch.equal(hf.completion_ids, ref)
    assert torch.equal(fast.completion_mask, hf.completion_mask)
    lengths = fast.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 2, lengths  # varied lengths
    assert len(set(ref[0].tolist())) > 3  # non-trivial sequences
    assert torch.allclose(fast.logprobs, hf.logprobs, atol=1e-4)


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
def test_logprobs_equal_fresh_forward(engine_cls):
    model = make_model("llama", peak=3.0, eos_bias=2.0)
    prompts = random_prompts([4, 8, 2])
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9)
    out = engine_cls(model, Tok()).generate(prompts, [3, 2, 3], params, torch.arange(100, 108))
    assert out.completion_mask.sum() > 8
    assert torch.allclose(out.logprobs, full_forward_logprobs(model, out, 0.7), atol=1e-4)


def test_sampling_distribution_matches_softmax_and_generate():
    model = make_model("qwen", peak=4.0)
    prompt = random_prompts([6])
    n, params = 3000, SamplingParams(max_new_tokens=3, temperature=0.9, top_p=0.95)
    fast = FastEngine(model, Tok()).generate(prompt, [n], params, torch.arange(n))
    hf = HFEngine(model, Tok()).generate(prompt, [n], params, torch.arange(n))
    with torch.no_grad():
        first = model(torch.tensor(prompt, device=model.device)).logits[0, -1].cpu() / 0.9
    exact = filter_logits(first[None], 0, 0.95)[0].softmax(-1).double()
    for out in (fast, hf):
        freq = torch.bincount(out.completion_ids[:, 0], minlength=VOCAB).double() / n
        assert torch.all((freq - exact).abs() <= 5 * (exact * (1 - exact) / n).sqrt() + 2 / n)
    for t in (1, 2):  # later positions: fast vs generate, two-sample bound per token
        on = (fast.completion_mask[:, t] > 0) & (hf.completion_mask[:, t] > 0)
        assert on.float().mean() > 0.9
        f1 = torch.bincount(fast.completion_ids[:, t], minlength=VOCAB).double() / n
        f2 = torch.bincount(hf.completion_ids[:, t], minlength=VOCAB).double() / n
        p = (f1 + f2) / 2
        assert torch.all((f1 - f2).abs() <= 5 * (p * (1 - p) * 2 / n).sqrt() + 3 / n)


# ---------------------------------------------------------------- fast-engine features and contract


def test_compaction_and_shared_prefill_change_no_output():
    model = make_model("llama", peak=3.0, eos_bias=2.5)
    prompts = random_prompts([5, 2, 7, 5])
    prompts[3] = list(prompts[0])  # a duplicate prompt shares its prefill
    counts, seeds = [4, 0, 3, 2], torch.arange(9) * 7919
    params = SamplingParams(max_new_tokens=10, temperature=1.1, top_k=20)
    outs = [
        FastEngine(model, Tok(), shared_prefill=s, compaction=c, cache=k).generate(
            prompts, counts, params, seeds
        )
        for s, c, k in [
            (True, True, "static"),
            (False, False, "static"),
            (True, False, "static"),
            (False, True, "dynamic"),
            (True, True, "dynamic"),
        ]
    ]
    outs.append(FastEngine(model, Tok(), compact_fraction=0.5).generate(prompts, counts, params, seeds))
    base = outs[0]
    assert base.completion_mask.sum(1).min() < 3 < base.completion_mask.sum(1).max()
    for out in outs[1:]:
        assert torch.equal(out.completion_ids, base.completion_ids)
        assert torch.equal(out.completion_mask, base.completion_mask)
        assert torch.allclose(out.logprobs, base.logprobs, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen", "llama"])
def test_layer_loop_matches_the_model_forward(kind):
    model = make_model(kind, peak=3.0, eos_bias=2.0)
    prompts, counts, seeds = random_prompts([3, 8, 5]), [3, 2, 4], torch.arange(9) * 31
    looped, full = FastEngine(model, Tok()), FastEngine(model, Tok(), layer_loop=False)
    assert isinstance(looped.forward, DecodeStack) and isinstance(full.forward, ModelForward)
    for params in (
        SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9),
        SamplingParams(max_new_tokens=9, greedy=True),
    ):
        a, b = (e.generate(prompts, counts, params, seeds) for e in (looped, full))
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_layer_loop_unfused_and_qwen3_match_the_model_forward():
    """The layer loop fuses q/k/v and gate/up into one matmul each on plain Linear layers; a layer with wrapped
    projections (as LoRA wraps them) runs them one by one, and Qwen3 normalises q/k per head: all equal the forward."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=128, eos_token_id=1, pad_token_id=0)).eval()
    with torch.no_grad():
        qwen3.lm_head.weight.mul_(3.0)
    wrapped = make_model("qwen", peak=3.0, eos_bias=2.0)
    layer = wrapped.model.layers[1]

    class Wrapped(torch.nn.Module):  # not a plain Linear: the loop must call it, not fuse its weight
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    layer.self_attn.k_proj = Wrapped(layer.self_attn.k_proj)
    layer.mlp.up_proj = Wrapped(layer.mlp.up_proj)
    prompts, counts, seeds = random_prompts([3, 8, 5]), [3, 2, 4], torch.arange(9) * 31
    for model in (qwen3, wrapped):
        looped, full = FastEngine(model, Tok()), FastEngine(model, Tok(), layer_loop=False)
        params = SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9)
        a, b = (e.generate(prompts, counts, params, seeds) for e in (looped, full))
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-6)
    plans = looped.forward.plans
    assert plans[0].qkv is not None and plans[1].qkv is None and plans[1].mlp is wrapped.model.layers[1].mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_grouped_attention(dtype):
    """The layer loop's one-query CPU attention gives grouped_attention's bits, over a cache view with capacity past
    its filled prefix, including a row whose keys are all blocked (a uniform average, not NaN)."""
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, dim = 6, 4, 2, 9, 16
    q = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
    buffers = torch.randn(2, batch, kv_heads, length + 5, dim, generator=g).to(dtype)
    keys, values = buffers[0, :, :, :length], buffers[1, :, :, :length]
    allowed = torch.rand(batch, 1, 1, length, generator=g) < 0.5
    allowed[0], allowed[1] = False, True
    out = decode_attention(q, keys, values, decode_bias(allowed, kv_heads, dtype), dim**-0.5)
    assert torch.equal(out, grouped_attention(q, keys, values, ~allowed, dim**-0.5))
    uniform = values[0].float().mean(1).repeat_interleave(heads // kv_heads, 0)
    assert torch.allclose(out[0, :, 0].float(), uniform, atol=1e-2)


def test_rotary_table_and_norms_give_transformers_bits():
    """The layer loop's rotation (cos and signed sin from the per-call table, then a roll) and its float32 norms
    (F.rms_norm) equal transformers' to the bit on the CPU (CUDA's fused F.rms_norm kernel reduces in another order:
    equal to float32 rounding there); a bfloat16 norm runs its module."""
    import copy

    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    model = make_model("qwen")
    engine = FastEngine(model, Tok())
    positions = torch.tensor([[0, 3, 7], [2, 5, 11]], device=model.device)
    x = torch.randn(2, 6, 3, model.config.hidden_size // 4, device=model.device)  # [B, q + k heads, Q, d]
    with torch.no_grad():
        q, k = apply_rotary_pos_emb(x[:, :4], x[:, 4:], *model.model.rotary_emb(x, positions))
        stack = engine.forward
        stack.rotary = stack.rotary_table(12)
        assert torch.equal(rotate(x, *stack.cos_sin(positions)), torch.cat([q, k], dim=1))
        norm = model.model.layers[0].input_layernorm
        h = torch.randn(5, 3, model.config.hidden_size, device=model.device) * 3
        if h.is_cuda:
            torch.testing.assert_close(norm_function(norm)(h), norm(h), rtol=2e-6, atol=1e-6)
        else:
            assert torch.equal(norm_function(norm)(h), norm(h))
    half = copy.deepcopy(norm).bfloat16()
    assert norm_function(half) is half


def test_dynamic_rotary_runs_the_model_forward():
    """Rotary types whose frequencies follow each call's longest position cannot use the per-call table."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS, pad_token_id=PAD,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).eval()
    engine = FastEngine(model, Tok())
    assert isinstance(engine.forward, ModelForward) and engine.fallback is None
    out = engine.generate(random_prompts([3, 5]), [2, 1], SamplingParams(max_new_tokens=4, greedy=True),
                          torch.arange(3))
    assert out.completion_ids.shape == (3, 4)


def test_row_depends_only_on_its_seed():
    model = make_model("qwen", peak=3.0, eos_bias=1.5)
    a, b, c = random_prompts([4, 11, 2])
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9)
    engine = FastEngine(model, Tok())
    alone = engine.generate([a], [3], params, torch.tensor([10, 11, 12]))
    mixed = engine.generate([b, a, c], [2, 3, 1], params, torch.tensor([1, 2, 12, 10, 11, 3]))
    rows = mixed.completion_mask.shape[1]
    width = max(rows, alone.completion_ids.shape[1])

    def pad(t):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=PAD)

    assert torch.equal(pad(mixed.completion_ids[[3, 4, 2]]), pad(alone.completion_ids))
    again = engine.generate([a], [3], params, torch.tensor([10, 11, 12]))
    assert torch.equal(again.completion_ids, alone.completion_ids)
    other = engine.generate([a], [3], params, torch.tensor([20, 21, 22]))
    assert not torch.equal(pad(other.completion_ids), pad(alone.completion_ids))


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
def test_top_k_one_equals_greedy(engine_cls):
    model = make_model("llama", peak=3.0, eos_bias=1.0)
    prompts, counts = random_prompts([5, 3]), [2, 3]
    engine = engine_cls(model, Tok())
    greedy = engine.generate(prompts, counts, SamplingParams(max_new_tokens=8, greedy=True), torch.arange(5))
    topk = engine.generate(
        prompts, counts, SamplingParams(max_new_tokens=8, temperature=0.8, top_k=1), torch.arange(5)
    )
    assert torch.equal(greedy.completion_ids, topk.completion_ids)


@pytest.mark.parametrize("engine_cls", [FastEngine, HFEngine])
def test_group_index_and_prompts_for_unequal_counts(engine_cls):
    model = make_model("qwen", eos_bias=1.0)
    prompts = random_prompts([2, 5, 3, 4])
    engine = engine_cls(model, Tok())
    out = engine.generate(prompts, [3, 0, 1, 2], SamplingParams(max_new_tokens=4), torch.arange(6))
    assert out.group_index.tolist() == [0, 0, 0, 2, 3, 3]
    assert out.prompt_ids.shape[1] == 4  # prompts without rollouts do not widen the padding
    for r, g in enumerate(out.group_index.tolist()):
        n = len(prompts[g])
        assert out.prompt_ids[r, -n:].tolist() == prompts[g] and int(out.prompt_mask[r].sum()) == n
    empty = engine.generate(prompts, [0, 0, 0, 0], SamplingParams(), torch.zeros(0, dtype=torch.long))
    assert empty.group_index.numel() == 0 and empty.completion_ids.shape == (0, 0)
    with pytest.raises(ValueError, match="one seed per row"):
        engine.generate(prompts, [1, 1, 1, 1], SamplingParams(), torch.arange(3))


def test_hf_engine_holds_one_step_of_logits(monkeypatch):
    """The log-probs are gathered step by step (a logits processor), not from every step's logits kept by
    `generate` ([rows, tokens, vocab]: 74 GiB at Qwen2's vocabulary for 512 rows of 256 tokens); same values."""
    model = make_model("llama", peak=3.0, eos_bias=2.0)
    asked, generate = [], model.generate

    def spy(*args, **kwargs):
        asked.append(kwargs["generation_config"])
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    params = SamplingParams(max_new_tokens=9, temperature=0.7, top_k=5)
    out = HFEngine(model, Tok()).generate(random_prompts([4, 8]), [3, 2], params, torch.arange(5))
    assert not asked[0].output_logits and not asked[0].output_scores
    assert torch.allclose(out.logprobs, full_forward_logprobs(model, out, 0.7), atol=1e-4)


def test_hf_engine_keeps_rng_and_train_mode():
    model = make_model("qwen").train()
    engine = HFEngine(model, Tok())
    prompts, params = random_prompts([4, 6]), SamplingParams(max_new_tokens=6)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = engine.generate(prompts, [2, 2], params, torch.arange(4))
    assert torch.equal(torch.get_rng_state(), state) and model.training
    assert torch.equal(
        engine.generate(prompts, [2, 2], params, torch.arange(4)).completion_ids, first.completion_ids
    )


def test_other_architecture_falls_back_to_hf_and_says_so(caplog):
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=4, eos_token_id=EOS,
                        pad_token_id=PAD, bos_token_id=EOS)
    model = Phi3ForCausalLM(config).eval()
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        engine = build_engine("fast", model, Tok())
    assert isinstance(engine.fallback, HFEngine) and "sliding" in caplog.text
    assert "sliding" in engine.fallback_reason
    out = engine.generate(
        random_prompts([3]), [2], SamplingParams(max_new_tokens=3, greedy=True), torch.arange(2)
    )
    assert out.completion_ids.shape[0] == 2


def test_llama_family_model_never_falls_back_quietly():
    """A model the fast engine exists for must not drop to model.generate: one error names the cause, the installed
    transformers and the option that asks for the slow path."""
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0, eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(FastPathUnavailable) as error:
        build_engine("fast", Qwen2ForCausalLM(config), Tok())
    message = str(error.value)
    assert "sliding" in message and transformers.__version__ in message and "rollout.engine: hf" in message


@pytest.mark.parametrize("kind", ["qwen", "llama"])
def test_fast_engine_drives_the_built_in_families_itself(kind):
    """Fails when the installed transformers moves an internal the layer loop needs (e.g. the cache argument)."""
    engine = build_engine("fast", make_model(kind), Tok())
    assert engine.fallback is None and engine.fallback_reason is None and isinstance(engine.forward, DecodeStack)


@pytest.mark.parametrize("engine, options, key", [
    ("fast", {"shared_prefil": False}, "rollout.engine_options.shared_prefil"),
    ("hf", {"compaction": True}, "rollout.engine_options.compaction"),
    ("ray", {"num_worker": 2}, "rollout.engine_options.num_worker"),
    ("ray", {"engine": "fast", "engine_options": {"cach": "dynamic"}}, "rollout.engine_options.engine_options.cach"),
    ("vllm", {"gpu_memory": 0.5}, "rollout.engine_options.gpu_memory"),
])
def test_unknown_engine_options_name_the_key(engine, options, key):
    with pytest.raises(ConfigError, match=re.escape(key) + ": not an option of the"):
        check_engine_options(engine, options)
    from podsrl.config import load_config

    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, [f"rollout.engine={engine}", f"rollout.engine_options={json.dumps(options)}"])


def test_known_engine_options_pass():
    check_engine_options("fast", {"shared_prefill": False, "cache": "dynamic", "pad_token_id": 0})
    check_engine_options("ray", {"num_workers": 1, "engine": "hf", "engine_options": {"eos_token_id": 2}})
    check_engine_options("vllm", {"gpu_memory_utilization": 0.3, "llm_options": {}})


# ---------------------------------------------------------------- the engine's weights copy (weights_dtype)


def test_weights_dtype_samples_from_a_copy_that_sync_weights_refreshes():
    """weights_dtype=bfloat16 on an fp32 policy: the engine samples from its own bf16 copy (made once: the same
    tensors after every sync), its log-probs float32 and not the fp32 model's; until sync_weights the copy keeps the
    old weights, after it the new ones (the outputs of a copy made from the updated model, to the bit)."""
    model = make_model("qwen", peak=3.0, eos_bias=2.0)
    prompts, counts, seeds = random_prompts([3, 8, 5]), [3, 2, 4], torch.arange(9) * 31
    params = SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9)
    half = FastEngine(model, Tok(), weights_dtype=torch.bfloat16)
    assert half.copy is not None and half.model is half.copy
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert half.model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers as from_pretrained keeps them
    addresses = [p.data_ptr() for p in half.model.parameters()]
    full = FastEngine(model, Tok()).generate(prompts, counts, params, seeds)
    old = half.generate(prompts, counts, params, seeds)
    assert old.logprobs.dtype == torch.float32
    both = (old.completion_mask > 0) & (full.completion_mask > 0)
    # bf16 weights move log-probs by ~1e-2 here (8 bits of mantissa), far past fp32 rounding (~1e-6)
    assert (old.logprobs - full.logprobs)[both].abs().max() > 1e-3
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    assert torch.equal(half.generate(prompts, counts, params, seeds).logprobs, old.logprobs)  # a copy: unchanged
    half.sync_weights(model)
    new = half.generate(prompts, counts, params, seeds)
    fresh = FastEngine(model, Tok(), weights_dtype=torch.bfloat16).generate(prompts, counts, params, seeds)
    assert torch.equal(new.completion_ids, fresh.completion_ids) and torch.equal(new.logprobs, fresh.logprobs)
    assert not torch.equal(new.logprobs, old.logprobs)
    assert [p.data_ptr() for p in half.model.parameters()] == addresses


def test_weights_dtype_equal_to_the_model_keeps_no_copy():
    model = make_model("qwen")
    for dtype in (None, torch.float32, "float32"):
        engine = FastEngine(model, Tok(), weights_dtype=dtype)
        assert engine.copy is None and engine.model is model
    assert FastEngine(model, Tok(), weights_dtype="bfloat16").model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="weights_dtype: one of float32, bfloat16"):
        FastEngine(model, Tok(), weights_dtype="bf16")

