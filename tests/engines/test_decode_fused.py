"""The decode step as CUDA runs it (DecodeStack.fused_attention: one SDPA a layer, the rotation rounded once, keys
and values written in one op), run on the CPU: the launches per layer that benchmarks/decode_ops.py counts, and the
tokens of the CPU's own path."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode_ops import step_launches
from podsrl.engines import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.models.llama import add_projection
from tests.engines.test_engines import make_model, random_prompts
from tests.tiny_lm import TokStub as Tok

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_decode_step_launches_at_most_15_ops_per_layer():
    """Two RMSNorms, the q/k/v matmul, the rotation of q, k and v (three), the cache write, attention, o_proj with
    its residual add (one addmm), the MLP with its residual add (four): 13 (23 before, with the CPU's attention;
    the CUDA path had per-layer mask work on top)."""
    per_layer = (step_launches(4)[0] - step_launches(2)[0]) / 2
    assert per_layer <= 15, per_layer


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=12, greedy=True),
                                    SamplingParams(max_new_tokens=12, temperature=0.8)])
def test_the_cuda_decode_path_gives_the_cpu_paths_tokens(params):
    """Same tokens; log-probs to float32 rounding (SDPA sums in another order, the rotation rounds once)."""
    model = make_model("qwen", peak=30.0 if params.greedy else 3.0)
    prompts, counts, seeds = random_prompts([3, 7, 5]), [3, 2, 3], torch.arange(8) * 7 + 1
    ref = FastEngine(model, Tok()).generate(prompts, counts, params, seeds)
    engine = FastEngine(model, Tok())
    engine.forward.fused_attention = True
    out = engine.generate(prompts, counts, params, seeds)
    assert engine.forward.fused
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert (out.logprobs - ref.logprobs).abs().max() <= 1e-5


def test_a_residual_add_inside_the_matmul_is_the_add_after_it():
    """add_projection: one addmm for a plain Linear without bias, residual + linear(x) to float32 rounding; a
    Linear with a bias (or a wrapped one) runs as the two ops."""
    torch.manual_seed(0)
    residual, x = torch.randn(5, 1, 8), torch.randn(5, 1, 12)
    plain, biased = torch.nn.Linear(12, 8, bias=False), torch.nn.Linear(12, 8)
    with torch.no_grad():
        torch.testing.assert_close(add_projection(residual, x, plain), residual + plain(x), rtol=1e-6, atol=1e-6)
        assert torch.equal(add_projection(residual, x, biased), residual + biased(x))
