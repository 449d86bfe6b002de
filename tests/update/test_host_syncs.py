"""The update makes the host wait for the device a fixed number of times per optimiser step, however many
micro-batches it runs: the micro-steps' losses and metrics come back in one read, their host columns and index plans
go over without waiting, and nothing reads a device value per micro-batch. On CUDA the count is torch's sync debug
mode's; on the CPU benchmarks/device_ops.py's count of what CUDA would wait for. Also in the time the trainer counts
as the update: the engine's weight sync, one foreach copy rather than a launch per parameter."""

from __future__ import annotations

import pytest
import torch

from benchmarks.device_ops import DeviceOps, count_syncs
from tests.engines.test_engines import Tok, make_model
from tests.update.test_rollout_correction_update import trainer_logprobs, with_sampler
from tests.update.test_shared_prompt import make_batch, make_updater, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# per optimiser step: the micro-steps' losses and metrics, the gradient norm; per update: the correction's metrics
SYNCS_PER_UPDATE = 3


def syncs_of_an_update(shared: bool, micro_batch_size: int) -> int:
    batch = make_batch([4, 1, 3, 2], 128, seed=1)
    batch = with_sampler(batch, trainer_logprobs(batch) - 0.1)
    model = tiny_model()
    updater = make_updater(model, shared, "algo.rollout_correction=token_tis",
                           f"optim.micro_batch_size={micro_batch_size}")
    updater.update(batch, torch.Generator().manual_seed(0))  # the optimiser's state exists from here on
    state = [t for s in updater.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return count_syncs(lambda: updater.update(batch, torch.Generator().manual_seed(1)),
                       [*model.parameters(), *model.buffers(), *state])


def test_host_syncs_per_update_do_not_grow_with_the_micro_batches():
    """The shared-prompt path (the default). The plain path adds transformers' own check of the padding mask in
    its mask creation (`_ignore_causal_mask_sdpa`: two reads a forward), which podsrl does not drive."""
    one, four = syncs_of_an_update(True, 10), syncs_of_an_update(True, 3)
    assert one == four <= SYNCS_PER_UPDATE


def test_the_engines_weight_sync_is_one_operation_not_one_per_parameter():
    from podsrl.engines.fast import FastEngine

    model = make_model("qwen")
    engine = FastEngine(model, Tok(), weights_dtype=torch.bfloat16)
    with DeviceOps([*model.parameters(), *engine.model.parameters()]) as ops:
        engine.sync_weights(model)
    assert len(list(engine.model.parameters())) > 10
    assert ops.totals()["launches"] == 1
    assert all(torch.equal(p, q.to(p.dtype)) for p, q in zip(engine.model.parameters(), model.parameters()))


def test_the_count_sees_what_cuda_would_wait_for():
    """The CPU count's own check (it emulates a device on the CPU, so this runs on the CPU on any device): a device
    value read, a pageable copy, boolean indexing and a host index into a device tensor are syncs; host work, a
    non-blocking copy and device arithmetic are not."""
    cpu, weight = torch.device("cpu"), torch.randn(4, 3)
    with DeviceOps([weight]) as ops:
        host = torch.arange(4) * 2  # host tensors: no launch, no sync
        float(host.sum())
        moved = torch.ones(4).to(cpu, non_blocking=True)
        (weight * 2).sum(1).add_(moved)
    assert ops.totals() == {"dispatches": 3, "launches": 3, "syncs": 0, "transfers": 1}
    with DeviceOps([weight]) as ops:
        float(weight.sum())
        weight.to(torch.float64).sum(1).to(cpu)  # already there: no transfer
        torch.ones(3).to(cpu)
        weight[weight > 0]
        weight[torch.tensor([0, 2])]
        weight.cpu() * torch.ones(4, 3)  # read back: a host tensor from then on
    assert ops.syncs["other"] == 5 and ops.transfers["other"] == 2
