"""The update taking the projections' forward from the sampling forward (podsrl/forward_record.py) equals the update
that computes it: metrics, gradients and weights, on the built-in model and ~10M-parameter Qwen2/Llama models with a
32k vocabulary and a small Qwen3, for selected and reordered rows of unequal lengths over several micro-batches. A
record is used only under the weights that made it and only for its own tokens; keeping it leaves generation
unchanged; its buffers go back to the engine when released."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from podsrl.batch import Problem, RolloutBatch, concat_batches
from podsrl.config import load_config
from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.tracking import read_metrics
from podsrl.trainer import Trainer
from tests.conftest import device_under_test, tiny_overrides
from tests.test_update_shared_prompt import TOL, grads, hf_model, make_updater, rel, tiny_model, weights

pytestmark = pytest.mark.usefixtures("one_thread")

KEEP = SamplingParams(max_new_tokens=12, temperature=0.8, keep_forward_bytes=1 << 30)
MODELS = {
    "tiny": (tiny_model, 20),
    "qwen2": (functools.partial(hf_model, "qwen2"), 32000),
    "llama": (functools.partial(hf_model, "llama"), 32000),
    "qwen3": (functools.partial(hf_model, "qwen3", vocab=300, hidden=64), 300),
}


def engine_for(model, vocab: int) -> FastEngine:
    """The fast engine with an eighth of the vocabulary as stop tokens: completions of unequal lengths."""
    model.to(device_under_test())
    return FastEngine(model, None, eos_token_id=list(range(3, 3 + vocab // 8)), pad_token_id=0)


def sampled_batch(engine: FastEngine, vocab: int, params: SamplingParams = KEEP, seed: int = 0) -> RolloutBatch:
    """Three prompts of unequal lengths and counts, sampled; the record stamped as the trainer does (no optimiser
    step yet)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    out = engine.generate(prompts, [4, 3, 5], params, torch.arange(12) + 100 * seed)
    batch = RolloutBatch(
        problems=[Problem(str(i), "", "") for i in range(3)], group_index=out.group_index, prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask, completion_ids=out.completion_ids, completion_mask=out.completion_mask.float(),
        truncated=out.truncated, advantages=torch.randn(12, generator=gen))
    if out.forward is not None:
        out.forward.weights_version = 0
        batch.sampling_forward, batch.sampling_row = out.forward, torch.arange(12)
    return batch


def update_both_ways(model, batch: RolloutBatch) -> dict[bool, tuple]:
    """One update of a copy of `model` per setting of update.reuse_sampling_forward: (metrics, gradients, weight
    change)."""
    out = {}
    for reuse in (True, False):
        copied = copy.deepcopy(model)
        updater = make_updater(copied, True, "optim.micro_batch_size=3", f"update.reuse_sampling_forward={reuse}")
        start = weights(copied).clone()
        metrics = updater.update(batch, torch.Generator().manual_seed(5))
        out[reuse] = (metrics, grads(copied), weights(copied) - start)
    return out


@pytest.mark.parametrize("kind", list(MODELS))
def test_update_from_the_sampling_forward_equals_the_computed_one(kind):
    make, vocab = MODELS[kind]
    model = make()
    batch = sampled_batch(engine_for(model, vocab), vocab)
    lengths = batch.completion_lengths()
    assert len(set(lengths.tolist())) > 2, lengths  # unequal completions
    # selected and reordered rows (as PODS keeps them), in micro-batches of 3
    batch = batch.select_rows(torch.tensor([11, 0, 3, 5, 7, 8, 2])).trim_padding()
    out = update_both_ways(model, batch)
    (m1, g1, w1), (m0, g0, w0) = out[True], out[False]
    assert m1.pop("update/sampling_forward_reused") == 1.0  # every micro-batch took it
    assert m1.keys() == m0.keys()
    for k in m0:
        assert abs(m1[k] - m0[k]) <= TOL * max(1.0, abs(m0[k])), (k, m1[k], m0[k])
    assert rel(g1, g0) <= TOL, rel(g1, g0)
    assert rel(w1, w0) <= 10 * TOL
    assert g0.abs().sum() > 0


def test_a_record_is_used_only_under_its_weights_and_for_its_tokens():
    model = tiny_model()
    engine = engine_for(model, 20)
    batch = sampled_batch(engine, 20)
    updater = make_updater(copy.deepcopy(model), True, "optim.micro_batch_size=4")
    assert updater.reuses_sampling_forward and updater.sampling_forward_bytes > 0

    def reused(b: RolloutBatch) -> float:
        return updater.update(b, torch.Generator().manual_seed(0))["update/sampling_forward_reused"]

    assert reused(batch) == 1.0
    assert reused(batch) == 0.0  # the optimiser has stepped since it was sampled
    other = sampled_batch(engine, 20, seed=1)  # another batch's record on these rows: its tokens differ
    batch.sampling_forward = other.sampling_forward
    batch.sampling_forward.weights_version = updater.weights_version
    assert reused(batch) == 0.0
    other.sampling_forward.release()
    other.sampling_forward.weights_version = updater.weights_version
    assert reused(other) == 0.0  # released: holds nothing


@pytest.mark.parametrize("overrides", [["optim.epochs=2"], ["optim.mini_batches=2"],
                                       ["update.shared_prompt=false"], ["update.reuse_sampling_forward=false"]])
def test_no_reuse_where_the_weights_could_differ_or_it_is_off(overrides):
    updater = make_updater(tiny_model(), "update.shared_prompt=false" not in overrides, *overrides)
    assert not updater.reuses_sampling_forward and updater.sampling_forward_bytes == 0


def test_lora_projections_are_not_recorded():
    from podsrl.lora import apply_lora

    model = apply_lora(hf_model("qwen2", vocab=300, hidden=64), rank=4, target_modules="all-linear")
    assert sampled_batch(engine_for(model, 300), 300).sampling_forward is None
    assert not make_updater(model, True).reuses_sampling_forward


def test_keeping_changes_no_token_and_buffers_return_when_released():
    model = tiny_model()
    engine = engine_for(model, 20)
    kept, plain = sampled_batch(engine, 20), sampled_batch(engine, 20, SamplingParams(max_new_tokens=12,
                                                                                       temperature=0.8))
    assert plain.sampling_forward is None
    assert torch.equal(kept.completion_ids, plain.completion_ids)
    lent = kept.sampling_forward
    second = sampled_batch(engine, 20).sampling_forward
    assert second.outputs[0][0].data_ptr() != lent.outputs[0][0].data_ptr()  # still lent: new buffers
    buffers = second.outputs[0][0].data_ptr()
    second.release()
    assert sampled_batch(engine, 20, seed=2).sampling_forward.outputs[0][0].data_ptr() == buffers  # given back
    too_small = SamplingParams(max_new_tokens=12, temperature=0.8, keep_forward_bytes=1000)
    assert sampled_batch(engine, 20, too_small).sampling_forward is None


def test_training_run_reuses_the_sampling_forward(tmp_path, warmup_cache):
    """PODS's selected rows, the built-in task: the same metrics with and without reuse, and every step reused."""
    records = {}
    for reuse in (True, False):
        overrides = tiny_overrides(tmp_path / str(reuse), warmup_cache, **{
            "update.reuse_sampling_forward": str(reuse).lower(), "train.max_steps": 3, "rollout.n": 8,
            "method": "pods", "pods.m": 4})
        Trainer(load_config(None, overrides)).train()
        records[reuse] = [r for r in read_metrics(tmp_path / str(reuse) / "metrics.jsonl") if "loss" in r]
    assert len(records[True]) == len(records[False]) == 3
    assert all(r["update/sampling_forward_reused"] == 1.0 for r in records[True])
    for a, b in zip(records[True], records[False]):
        for k in ("loss", "entropy", "grad_norm", "reward", "clip_ratio/region_mean"):
            if k in b:
                assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(b[k])), (k, a[k], b[k])


def test_concatenated_batches_carry_one_record():
    """Rounds and refills concatenate batches of several generate calls: their records are merged into one, and the
    update from it equals the computing update; batches sampled under different weights keep none."""
    model = tiny_model()
    engine = engine_for(model, 20)
    first = sampled_batch(engine, 20).select_rows(torch.tensor([0, 5, 9, 3]))
    second = sampled_batch(engine, 20, seed=1).select_rows(torch.tensor([11, 2, 7]))
    batch = concat_batches([first, second], pad_token_id=0)
    assert batch.sampling_row.tolist() == [0, 5, 9, 3, 12 + 11, 12 + 2, 12 + 7]
    out = update_both_ways(model, batch.trim_padding())
    (m1, g1, _), (m0, g0, _) = out[True], out[False]
    assert m1["update/sampling_forward_reused"] == 1.0
    assert rel(g1, g0) <= TOL and abs(m1["entropy"] - m0["entropy"]) <= TOL * max(1.0, abs(m0["entropy"]))
    second.sampling_forward.weights_version = 1
    assert concat_batches([first, second], pad_token_id=0).sampling_forward is None


def test_several_generate_calls_a_step_release_every_record(tmp_path, warmup_cache):
    """Reinforce-Ada samples in rounds and trains their concatenation, which carries their merged record: every
    round's record is released after the update, so the engine's buffers are reused from step to step instead of
    allocated anew each call."""
    overrides = tiny_overrides(tmp_path, warmup_cache, **{"method": "reinforce_ada", "reinforce_ada.max_rounds": 3,
                                                         "reinforce_ada.round_repeat": 4, "rollout.n": 2})
    trainer = Trainer(load_config(None, overrides))
    calls = 0
    for _ in range(3):
        record = trainer.train_step()
        calls += len(record.sampling_forwards)
        assert record.sampling_forwards and all(not f.outputs for f in record.sampling_forwards)
        assert record.metrics["update/sampling_forward_reused"] == 1.0
        assert not any(b.lent for b in trainer.engine._buffers)
        # at most one set of buffers per round of a step (without the release: one per call so far)
        assert len(trainer.engine._buffers) <= 3
    assert calls > 3
    trainer.logger.close()
    trainer.engine.close()
