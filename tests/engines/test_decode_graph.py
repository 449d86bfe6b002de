"""The fast engine's static-shape decode step (podsrl/engines/decode_step.py): it compiles as one graph, gives the
eager tokens, compiles once per bucket over a whole generate call with compaction, and keeps the CUDA-graph contract
(fixed addresses, a replay reading the state it captured) on the CPU through a stand-in for the graph that
replays the captured operations on the memory they read (tests/engines/graph_stand_in.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from podsrl.engines import SamplingParams
from podsrl.engines.decode_step import Buckets, StepRunner
from podsrl.engines.fast import SYNC_EVERY, FastEngine
from podsrl.errors import ConfigError
from podsrl.models import decode
from tests.conftest import device_under_test
from tests.engines.graph_stand_in import RecordedGraphs
from tests.engines.test_engines import make_model, random_prompts
from tests.tiny_lm import TokStub as Tok

pytestmark = pytest.mark.usefixtures("one_thread")
on_cpu = pytest.mark.cpu_only("compiles and stands in for CUDA graphs on the CPU")

SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=20)
GREEDY = SamplingParams(max_new_tokens=10, greedy=True)
# The compiled step reorders float reductions (norms, softmax, cumsum): its log-probs equal the eager ones to a few
# float32 ulps of values of magnitude ~1-10 (measured: 4.8e-7), so 1e-5 is 20x margin; the tokens are equal exactly
# (a reordering flips a token only if a uniform or an argmax falls within ~1e-6 of a boundary).
LOGPROB_TOL = 1e-5
# On CUDA the bucket's padded shapes let cuBLAS pick other kernels (other reduction orders) than the eager live
# shapes: float32 logits agree to ~1e-6 relative; 1e-4, as the engines' other CUDA comparisons
CUDA_TOL = 1e-4


def request(rows_per_prompt=(3, 2, 3)):
    prompts = random_prompts([3, 7, 5])
    return prompts, list(rows_per_prompt), torch.arange(sum(rows_per_prompt)) * 7 + 1


def assert_same(out, ref, tol=LOGPROB_TOL):
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert torch.equal(out.completion_mask, ref.completion_mask)
    assert out.logprobs.dtype == torch.float32
    assert (out.logprobs - ref.logprobs).abs().max() <= tol


@on_cpu
@pytest.mark.slow
def test_inductor_compiled_step_gives_the_eager_tokens():
    """torch.compile(decode_step, fullgraph=True, dynamic=False) with inductor: one graph per bucket (no break: no
    .item(), no data-dependent shape inside), greedy and sampled, the eager tokens. One bucket each (no compaction,
    a cache block past the longest row) keeps it to two compilations (~35 s each on a shared 2-core machine)."""
    prompts, counts, seeds = request()
    torch._dynamo.reset()
    counters.clear()
    # sampled: EOS likely enough that rows finish at varied steps; greedy: no EOS bias (greedy would pick it first)
    for model, params in ((make_model("qwen", peak=3.0, eos_bias=2.0), SAMPLED), (make_model("qwen", peak=30.0), GREEDY)):
        compiled = FastEngine(model, Tok(), compile=True, compaction=False, cache_block=32)
        ref = FastEngine(model, Tok()).generate(prompts, counts, params, seeds)
        assert len(set(ref.completion_ids[:, -1].tolist())) > 1
        assert_same(compiled.generate(prompts, counts, params, seeds), ref)
        assert len(compiled.runner.visited) == 1
    assert counters["stats"]["unique_graphs"] == 2


@on_cpu
def test_generate_compiles_once_per_bucket_it_visits():
    """A whole generate call with finished-row compaction: dynamo (fullgraph, dynamic=False) compiles the step once
    per (rows, cache length) bucket visited, fewer than the steps; a second call over the same buckets compiles
    nothing. Were a shape to leak into the step (the live rows, the filled length), each step would compile anew."""
    model = make_model("llama", peak=3.0, eos_bias=2.5)
    prompts, counts, seeds = request((5, 4, 7))
    ref = FastEngine(model, Tok()).generate(prompts, counts, SAMPLED, seeds)
    torch._dynamo.reset()
    counters.clear()
    engine = FastEngine(model, Tok(), compile="eager", cache_block=4)  # dynamo's guards and graphs, no codegen
    assert_same(engine.generate(prompts, counts, SAMPLED, seeds), ref)
    visited = set(engine.runner.visited)
    rows = {key[0] for key in visited}
    lengths = {key[1] for key in visited}
    steps = ref.completion_ids.shape[1] - 1
    # compaction (at the host's reads, every SYNC_EVERY steps) and growth both bucketed
    assert len(rows) >= 2 and len(lengths) >= 2 and len(visited) < steps
    assert rows <= {1, 2, 4, 8, 16} and all(length % 4 == 0 for length in lengths)
    assert counters["stats"]["unique_graphs"] == len(visited)
    assert_same(engine.generate(prompts, counts, SAMPLED, seeds), ref)
    assert counters["stats"]["unique_graphs"] == len(visited)


def graph_engine(model, block=4):
    engine = FastEngine(model, Tok())
    engine.runner = StepRunner()
    engine.runner.graphs = RecordedGraphs()
    engine.buckets = Buckets(block=block)
    return engine


@on_cpu
def test_graph_replay_contract_across_calls_and_weight_updates(monkeypatch):
    """Captured once per bucket, replayed after: the same tokens as eager decoding, again on a second call (graphs
    reused, nothing captured), after an in-place weight update (the plans' fused weights refreshed in place: the
    replays sample from the new weights, no bucket captured twice) and after a larger call that reallocates the
    state (graphs dropped and captured afresh: replaying the old ones would read the old state)."""
    model = make_model("qwen", peak=3.0, eos_bias=2.0)
    prompts, counts, seeds = request()
    engine, eager = graph_engine(model), FastEngine(model, Tok())
    RecordedGraphs.captures = 0
    for params in (SAMPLED, GREEDY):
        assert_same(engine.generate(prompts, counts, params, seeds), eager.generate(prompts, counts, params, seeds))
    first = RecordedGraphs.captures
    assert first == len(engine.runner.visited) > 2
    assert_same(engine.generate(prompts, counts, SAMPLED, seeds), eager.generate(prompts, counts, SAMPLED, seeds))
    assert RecordedGraphs.captures == first
    with torch.no_grad():  # as the optimiser does: in place
        for p in model.parameters():
            p.mul_(1.1)
    after = engine.generate(prompts, counts, SAMPLED, seeds)
    assert_same(after, eager.generate(prompts, counts, SAMPLED, seeds))
    assert RecordedGraphs.captures == len(engine.runner.visited)  # only buckets the new weights' rows reach anew
    before = RecordedGraphs.captures
    bigger = (9, 9, 9)
    prompts_big, counts_big, seeds_big = request(bigger)
    assert_same(engine.generate(prompts_big, counts_big, SAMPLED, seeds_big),
                eager.generate(prompts_big, counts_big, SAMPLED, seeds_big))
    assert engine.state.rows == 32
    assert RecordedGraphs.captures - before == len(engine.runner.graphs.graphs)  # all captured afresh


def reallocating_refresh(plan, layer):
    """A weight refresh that gives the fused q/k/v and gate/up weights new memory (`set_`) instead of copying the
    new weights into theirs, and leaves the stack's binding (the graphs it keeps) as it was."""
    attn = layer.self_attn
    plan.qkv[0].set_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    plan.gate_up.set_(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))


@on_cpu
@pytest.mark.parametrize("reallocates", [False, True])
def test_a_tensor_reallocated_without_dropping_the_graphs_replays_stale_memory(monkeypatch, reallocates):
    """The stand-in replays the captured operations on the memory they read, as a GPU replays a graph's kernels on
    its addresses: after an in-place weight update, a refresh in place samples the eager engine's tokens over the
    new weights; one that re-allocates the fused weights without dropping the graphs samples from the old ones
    (a stand-in re-running the Python step read the new tensors, and such a path passed)."""
    model = make_model("qwen", peak=3.0, eos_bias=2.0)
    prompts, counts, seeds = request()
    engine = graph_engine(model)
    engine.generate(prompts, counts, SAMPLED, seeds)
    captured = RecordedGraphs.captures
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    if reallocates:
        monkeypatch.setattr(decode, "refresh_fused", reallocating_refresh)
    replayed = engine.generate(prompts, counts, SAMPLED, seeds)
    fresh = FastEngine(model, Tok()).generate(prompts, counts, SAMPLED, seeds)
    assert RecordedGraphs.captures == captured or not reallocates  # the stale path replays what it captured
    gap = (replayed.logprobs - fresh.logprobs).abs().max()
    assert gap > 1e-3 if reallocates else gap <= LOGPROB_TOL


@on_cpu
def test_the_bucketed_loop_reads_the_device_every_few_steps_not_every_step(monkeypatch):
    """Under buckets the host reads the finished rows and the top column every SYNC_EVERY steps (a read waits for
    the device, so the GPU runs ahead of the loop only between reads), and the tokens stay the eager engine's.
    Before, the loop read them after every step: 40 steps, at least 40 reads."""
    model = make_model("qwen", peak=3.0, eos_bias=-5.0)  # rows run to max_new_tokens: no compaction's reads
    prompts, counts, seeds = request((4, 4, 4))
    params = SamplingParams(max_new_tokens=40, temperature=0.8)
    ref = FastEngine(model, Tok()).generate(prompts, counts, params, seeds)
    engine = graph_engine(model, block=16)
    reads, steps = [], []
    for name in ("tolist", "item", "nonzero", "cpu"):  # what makes the host wait for the device
        def counted(tensor, *args, _original=getattr(torch.Tensor, name), _name=name, **kwargs):
            reads.append(_name)
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    run = StepRunner.__call__
    monkeypatch.setattr(StepRunner, "__call__", lambda runner, *args: (steps.append(args[2:4]), run(runner, *args))[1])
    out = engine.generate(prompts, counts, params, seeds)
    monkeypatch.undo()
    assert_same(out, ref)
    # beyond one read per SYNC_EVERY steps, the call's own: the prompts' lengths, the admitted rows' seeds, the read
    # after the admission, the two outputs
    assert len(steps) >= 39 and len(reads) <= len(steps) // SYNC_EVERY + 5, (len(steps), " ".join(reads))


def test_buckets_round_rows_and_lengths():
    buckets = Buckets(block=64)
    assert [buckets.rows(n) for n in (1, 2, 3, 16, 17, 64)] == [1, 2, 4, 16, 32, 64]
    assert [buckets.length(n) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
    exact = Buckets(exact=True)
    assert exact.rows(17) == 17 and exact.length(65) == 65


@on_cpu
def test_graph_options_name_what_they_need():
    model = make_model("qwen")
    assert FastEngine(model, Tok()).runner.graphs is None  # CPU: eager by default
    with pytest.raises(ConfigError, match="cuda_graphs.*not a CUDA device"):
        FastEngine(model, Tok(), cuda_graphs=True)
    with pytest.raises(ConfigError, match="compile.*layer loop"):
        FastEngine(model, Tok(), compile=True, layer_loop=False)
    with pytest.raises(ConfigError, match="cuda_graphs.*cache: static"):
        FastEngine(model, Tok(), cuda_graphs=True, cache="dynamic")
    with pytest.raises(ConfigError, match="cache_block"):
        FastEngine(model, Tok(), cache_block=0)


@on_cpu
def test_bucket_padding_rows_left_by_a_wider_call_stay_in_range():
    """A bucket's padding rows hold an earlier call's rows: one whose left padding (18) exceeds this call's columns
    would look up a negative position (an index error on the CPU, a device assert on CUDA) unless reset."""
    model = make_model("qwen", peak=3.0, eos_bias=2.0)
    engine, eager = graph_engine(model), FastEngine(model, Tok())
    wide = random_prompts([20, 2])
    engine.generate(wide, [4, 4], SAMPLED, torch.arange(8))
    narrow, counts, seeds = random_prompts([3, 4], seed=2), [3, 2], torch.arange(5)
    assert_same(engine.generate(narrow, counts, SAMPLED, seeds), eager.generate(narrow, counts, SAMPLED, seeds))
    assert engine.state.rows == 8


@pytest.mark.skipif(device_under_test().type != "cuda", reason="CUDA graphs need a CUDA device (pytest --device cuda)")
def test_cuda_graphs_give_the_eager_tokens():
    """On CUDA the graphs are on by default: captured once per bucket, the eager engine's tokens (greedy and
    sampled), again after an in-place weight update, and from a bigger call that reallocates the state."""
    model = make_model("qwen", peak=3.0, eos_bias=2.0)
    graphs, eager = FastEngine(model, Tok(), cache_block=8), FastEngine(model, Tok(), cuda_graphs=False)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    prompts, counts, seeds = request()
    for params in (SAMPLED, GREEDY, SAMPLED):
        assert_same(graphs.generate(prompts, counts, params, seeds), eager.generate(prompts, counts, params, seeds),
                    CUDA_TOL)
    assert len(graphs.runner.graphs.graphs) == len(graphs.runner.visited) > 2
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    assert_same(graphs.generate(prompts, counts, SAMPLED, seeds), eager.generate(prompts, counts, SAMPLED, seeds),
                CUDA_TOL)
    prompts_big, counts_big, seeds_big = request((9, 9, 9))
    assert_same(graphs.generate(prompts_big, counts_big, SAMPLED, seeds_big),
                eager.generate(prompts_big, counts_big, SAMPLED, seeds_big), CUDA_TOL)
