"""The update's shape ladder (podsrl/models/shape_ladder.py): the attention blocks' sizes repeat across batches when
laid out on the ladder (CUDA's default), and the padding changes nothing: the laddered shared-prompt path equals the
plain path, through the CPU's matmul attention and through scaled_dot_product_attention (what CUDA runs)."""

from __future__ import annotations

import functools

import pytest
import torch

from benchmarks.update_shapes import new_per_update, shapes_per_update
from podsrl.models import packed_layout
from podsrl.models.packed_layout import build_plan
from podsrl.models.shape_ladder import ladder_default, rung
from tests.update.test_shared_prompt import grads, hf_model, make_batch, make_updater, rel, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rungs_cover_every_size_with_at_most_a_quarter_of_padding():
    sizes = range(1, 2**14 + 1)
    assert all(n <= rung(n) <= max(n, 1.25 * n) for n in sizes)
    assert all(rung(rung(n)) == rung(n) for n in sizes)  # a rung is its own size
    assert len({rung(n) for n in sizes}) == 8 + 4 * 11  # 1-8, then four a doubling up to 2^14
    assert ladder_default("cuda") and not ladder_default("cpu")


def test_laddered_plan_pads_every_block_to_a_rung():
    batch = make_batch([4, 3, 2], 128, seed=6, max_len=18)
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, torch.device("cpu"))
    exact, laddered = build_plan(*args), build_plan(*args, ladder=True)
    assert build_plan(*args, ladder=None).prompt_shape == exact.prompt_shape  # the CPU keeps the exact layout
    sizes = [*laddered.prompt_shape, *(s for b in laddered.buckets for s in (b.rows, b.width, b.prompt_width))]
    assert all(rung(s) == s for s in sizes)
    exact_sizes = [*exact.prompt_shape, *(s for b in exact.buckets for s in (b.rows, b.width, b.prompt_width))]
    assert sizes != exact_sizes  # this batch needs padding (9 rows, 17 inputs)
    assert torch.equal(laddered.ids, exact.ids) and torch.equal(laddered.targets, exact.targets)


@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
@pytest.mark.parametrize("kind", ["tiny", "llama"])
def test_laddered_path_equals_plain_path(monkeypatch, attention, kind):
    """Metrics and gradients of a whole update, laddered shared-prompt path vs plain path."""
    if attention == "sdpa":
        monkeypatch.setattr(packed_layout, "block_attend", packed_layout.sdpa_block_attend)
    make = tiny_model if kind == "tiny" else functools.partial(hf_model, "llama", vocab=300, hidden=64)
    batch = make_batch([4, 3, 2, 1], 128 if kind == "tiny" else 300, seed=7, max_len=18)
    out = {}
    for shared in (True, False):
        model = make()
        updater = make_updater(model, shared, "optim.micro_batch_size=9", "rollout.max_new_tokens=18")
        if shared:
            updater.shared[id(model)].ladder = True
        out[shared] = (updater.update(batch, torch.Generator().manual_seed(5)), grads(model))
    (m1, g1), (m0, g0) = out[True], out[False]
    for k in m0:
        assert abs(m1[k] - m0[k]) <= 1e-5 * max(1.0, abs(m0[k])), (k, m1[k], m0[k])
    assert rel(g1, g0) <= 1e-5 and g0.abs().sum() > 0


@pytest.mark.slow
def test_study_updates_bring_no_new_attention_shapes_after_warm_up():
    """benchmarks/update_shapes.py's count on a short run: with the ladder, updates after the 10th bring no shape
    the first ten had not (the exact layout: ~6 new ones each, as before the ladder)."""
    new = new_per_update(shapes_per_update(12, ladder=True, hidden=16))
    assert sum(new[10:]) == 0, new


@pytest.mark.parametrize("rows", [256, 512])
def test_laddered_length_cuts_do_not_follow_the_batch(rows):
    """The study's lengths (benchmarks/update_ops.py: completions of 10-35 tokens + EOS) in one micro-batch of 256
    rows or of 512 (optim.micro_batch_size=auto on an H200): on the ladder every batch is cut at the same lengths.
    With a cut threshold fixed in slots, 512 rows' 19 -> 14 cut saved ~410-555 slots against 512 and came and went
    between batches, each time new attention shapes."""
    layouts = set()
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(10, 36, (rows,), generator=gen) + 1
        width = int(lengths.max())
        completion_mask = (torch.arange(width) < lengths[:, None]).long()
        completion_ids = torch.randint(1, 20, (rows, width), generator=gen) * completion_mask
        prompt_ids = torch.randint(1, 20, (rows // 16, 12), generator=gen).repeat_interleave(16, dim=0)
        plan = build_plan(prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask,
                          torch.device("cpu"), ladder=True)
        layouts.add(tuple(b.width for b in plan.buckets))
    assert len(layouts) == 1, layouts
