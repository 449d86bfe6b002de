"""The update's per-micro-batch work: fused weights made once per optimiser step, not per layer and micro-batch; no
mask work in the layers' attention calls (the plan's masks are made once per micro-batch on the host)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from benchmarks.device_ops import DeviceOps
from podsrl.models import packed, packed_layout
from tests.update.test_shared_prompt import make_batch, make_updater, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_attention_calls_do_no_mask_work(monkeypatch):
    """On the path CUDA runs (scaled_dot_product_attention), a layer's attention reads the plan's masks as they are:
    no all / bitwise / masked_fill launches in the forward."""
    monkeypatch.setattr(packed_layout, "block_attend", packed_layout.sdpa_block_attend)
    model = tiny_model()
    updater = make_updater(model, True, "optim.micro_batch_size=12")
    batch = make_batch([4, 3, 2, 3], 128, seed=9)
    rows = torch.arange(batch.num_rollouts)
    with DeviceOps([*model.parameters(), *model.buffers()]) as ops:
        (logp, _), _ = updater._forward(model, batch, rows)
    names = {name for (_, name) in ops.launch_names}
    assert "_scaled_dot_product_flash_attention_for_cpu" in names and logp.isfinite().all()
    assert not names & {"all", "bitwise_not", "bitwise_or", "masked_fill"}, names


def test_fused_weights_are_made_once_per_optimiser_step(monkeypatch):
    """Not per layer and micro-batch; and made again after each step, so the next forward uses the new weights
    (the shared-prompt path equals the plain path over several mini-batches: test_shared_prompt.py)."""
    made = Counter()
    original = packed.layer_plan

    def counted(layer, index, *args, **kwargs):
        made[index] += 1
        return original(layer, index, *args, **kwargs)

    monkeypatch.setattr(packed, "layer_plan", counted)
    model = tiny_model()
    updater = make_updater(model, True, "optim.micro_batch_size=3", "optim.mini_batches=2")
    updater.update(make_batch([4, 3, 2, 3], 128, seed=9), torch.Generator().manual_seed(0))
    # 12 rows in micro-batches of 3: the old log-probs' pass (no gradient), then two mini-batches (an optimiser step
    # each) of two micro-batches: a plan each, not one per micro-batch (8)
    assert made == {i: 3 for i in range(model.config.num_hidden_layers)}, made
