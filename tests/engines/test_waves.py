"""The fast engine's waves and what it keeps: at most max_rows rows decode at once, the others queued and admitted
into the places of finished rows, with the tokens of all rows at once; the state kept between calls (CUDA graphs'
addresses) stays one wave whatever the call (an eval's many rows), within what the memory plan counts, and
`release` (the trainer, before the update) frees it."""

from __future__ import annotations

import pytest
import torch

from podsrl.engines import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.errors import ConfigError
from podsrl.planning.memory import generation_in_flight
from podsrl.planning.workload import Workload, model_shape
from tests.conftest import device_under_test
from tests.engines.test_decode_graph import CUDA_TOL, graph_engine
from tests.engines.test_engines import make_model, random_prompts
from tests.tiny_lm import TokStub as Tok

pytestmark = pytest.mark.usefixtures("one_thread")
ON_CUDA = device_under_test().type == "cuda"
# CPU: a row's float ops do not depend on its batch (the eager engine's claim, test_row_depends_only_on_its_seed),
# its log-probs then equal to float32 rounding of other reduction orders (1e-5, as the engines' other comparisons);
# on CUDA other batch sizes pick other cuBLAS kernels (CUDA_TOL)
LOGPROB_TOL = CUDA_TOL if ON_CUDA else 1e-5
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=20, return_logprobs=True)


def request():
    prompts = random_prompts([3, 7, 5, 2, 6], seed=3)
    counts = [4, 4, 0, 4, 2]
    return prompts, counts, torch.arange(sum(counts)) * 7919 + 5


def graphed(model, max_rows=None):
    """The engine that keeps its state between calls: real CUDA graphs on CUDA, their CPU stand-in elsewhere."""
    if ON_CUDA:
        return FastEngine(model, Tok(), max_rows=max_rows)
    engine = graph_engine(model)
    engine.max_rows = max_rows
    return engine


def test_waves_give_the_tokens_of_all_rows_at_once():
    """One row at a time, one prompt group (4 rows), 6 rows (groups refilled into finished rows' places, a group
    split when a wave is smaller), 15 (all 14 would need a 16-row bucket) and all at once: the same tokens and
    log-probs, also without compaction (rows are refilled whenever some finished) and without the shared prefill;
    neither a step nor the state kept for the graphs holds more rows than max_rows."""
    model = make_model("qwen", peak=3.0, eos_bias=2.0)
    prompts, counts, seeds = request()
    whole = FastEngine(model, Tok(), cuda_graphs=False).generate(prompts, counts, SAMPLED, seeds)
    lengths = whole.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows finish at different steps: places to refill
    for max_rows in (1, 4, 6, 15):
        for engine in (FastEngine(model, Tok(), cuda_graphs=False, max_rows=max_rows), graphed(model, max_rows),
                       FastEngine(model, Tok(), cuda_graphs=False, max_rows=max_rows, compaction=False,
                                  shared_prefill=False)):
            out = engine.generate(prompts, counts, SAMPLED, seeds)
            assert torch.equal(out.completion_ids, whole.completion_ids), max_rows
            assert torch.equal(out.completion_mask, whole.completion_mask)
            assert (out.logprobs - whole.logprobs).abs().max() <= LOGPROB_TOL
            assert max(rows for rows, _, _ in engine.runner.visited) <= max_rows
            assert engine.state is None or engine.state.rows <= max_rows


def test_max_rows_is_a_positive_integer():
    model = make_model("qwen")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="max_rows"):
            FastEngine(model, Tok(), max_rows=bad)


def held_bytes(engine, baseline: int) -> int:
    """What the engine keeps between calls: on CUDA the allocator's bytes beyond `baseline`, on the CPU the bytes
    of its kept tensors (the step state and cache)."""
    if ON_CUDA:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - baseline
    return engine.state.nbytes if engine.state is not None else 0


def test_kept_state_after_an_eval_and_a_training_call_is_what_the_plan_counts():
    """An eval-sized call (24 rows) then a training call (8 rows) with max_rows 8: the engine keeps one wave's
    state, no more than the plan's in-flight cache for 8 rows counts; released (before the update) it keeps nothing.
    Before waves, the eval call's 24 rows stayed kept (a 32-row state) through the updates."""
    model = make_model("qwen", peak=3.0, eos_bias=1.0)
    wave = 8
    engine = graphed(model, wave)
    eval_prompts = random_prompts([31, 3, 5, 6, 2, 4], seed=5)
    params = SamplingParams(max_new_tokens=9, temperature=1.0)  # 31 + 9 positions: whole blocks on the CPU stand-in
    # the baseline: the engine's fused weights and rotary table bound at the eval's positions, nothing kept
    engine.generate(eval_prompts[:1], [1], params, torch.arange(1))
    engine.release()
    baseline = torch.cuda.memory_allocated() if ON_CUDA else 0
    assert held_bytes(engine, baseline) == 0
    engine.generate(eval_prompts, [4] * 6, params, torch.arange(24))
    engine.generate(eval_prompts[:2], [4, 4], params, torch.arange(8) + 100)
    shape = model_shape(model.config)
    work = Workload(prompts=2, n=4, m=4, prompt_length=31, completion_length=9, device=device_under_test().type,
                    rows_in_flight=wave)
    planned = generation_in_flight(shape, work)["kv_cache"]
    held = held_bytes(engine, baseline)
    # on CUDA also the allocator's 512-byte blocks of the state's small tensors and the graphs' outputs: within the
    # plan's count of the prefill's cache, which is not kept
    assert 0 < held <= planned
    engine.release()
    assert held_bytes(engine, baseline) == 0
