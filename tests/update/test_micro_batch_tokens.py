"""optim.micro_batch_tokens: micro-batches cut by a token budget (verl's ppo_max_token_len_per_gpu). Every cut holds
at most the budget (a longer row alone) and the row cap, rows keep their order, ranks under FSDP2 run as many
micro-batches, and an update gives the same loss and gradients as row micro-batching."""

from __future__ import annotations

import functools

import pytest
import torch

from podsrl.algo.micro_batches import row_tokens, split_rows
from podsrl.config import load_config
from tests.update.test_shared_prompt import grads, hf_model, make_batch, make_updater, rel

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5  # the project's float32 path-equality bound: the same sums in other micro-batches, reordered


def test_cuts_hold_the_budget_and_the_row_cap():
    lengths = torch.tensor([5, 3, 9, 2, 2, 2, 7, 1, 4, 12, 3])
    rows = torch.arange(len(lengths))
    for budget in (1, 4, 9, 10, 13, 100):
        for cap in (1, 2, 3, 100):
            cuts = split_rows(rows, cap, lengths, budget)
            assert torch.cat(cuts).tolist() == rows.tolist()  # every row once, in order
            for cut in cuts:
                assert 1 <= cut.numel() <= cap
                assert lengths[cut].sum() <= budget or cut.numel() == 1  # a longer row runs alone
            # greedy: no cut could have taken the next row
            for a, b in zip(cuts, cuts[1:]):
                assert a.numel() == cap or lengths[a].sum() + lengths[b[0]] > budget


def test_zero_budget_is_rows_only():
    rows = torch.arange(10)
    assert [c.tolist() for c in split_rows(rows, 4)] == [c.tolist() for c in rows.split(4)]
    assert [c.tolist() for c in split_rows(rows, 4, torch.ones(10, dtype=torch.long), 0)] == \
        [c.tolist() for c in rows.split(4)]


def test_row_tokens_count_prompt_and_completion():
    batch = make_batch([2, 3], vocab=50, seed=3)
    expected = [int(batch.prompt_mask[i].sum() + batch.completion_mask[i].sum()) for i in range(5)]
    assert row_tokens(batch.prompt_mask, batch.completion_mask).tolist() == expected


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_split_their_share_and_fsdp_runs_as_many(strategy):
    from podsrl.distributed import DataParallel, DistContext
    from podsrl.fsdp import FullyShardedDataParallel

    cls = FullyShardedDataParallel if strategy == "fsdp" else DataParallel
    lengths = torch.tensor([20, 1, 1, 1, 1, 1, 1, 20, 20, 20, 2, 2])
    rows, budget, world = torch.arange(12), 22, 2
    shares = []
    for rank in range(world):
        dp = cls.__new__(cls)  # the split needs no process group
        dp.ctx = DistContext(torch.device("cpu"), rank, world)
        shares.append(dp.micro_batches(rows, 8, lengths, budget))
    assert torch.cat([m for share in shares for m in share]).tolist() == rows.tolist()
    assert all(lengths[m].sum() <= budget or m.numel() == 1 for share in shares for m in share)
    counts = [len(share) for share in shares]
    # rank 0's share [20, 1, 1, 1, 1, 1] is cut [20, 1, 1] [1, 1, 1]; rank 1's [1, 20, 20, 20, 2, 2] in 4
    if cls.lockstep:  # rank 0 runs two empty micro-batches beside rank 1's last two
        assert counts == [4, 4] and [m.numel() for m in shares[0]] == [3, 3, 0, 0]
    else:
        assert counts == [2, 4]


def count_micro_steps(updater) -> list[torch.Tensor]:
    seen = []
    step = updater._micro_step

    def spy(batch, rows, *args, **kwargs):
        seen.append(rows.clone())
        return step(batch, rows, *args, **kwargs)

    updater._micro_step = spy
    return seen


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prompt", "plain"])
def test_same_update_as_row_micro_batches(shared):
    make = functools.partial(hf_model, "qwen2", vocab=300, hidden=64, layers=2)
    batch = make_batch([4, 1, 3, 2, 5], 300, seed=2, max_len=12)
    lengths = row_tokens(batch.prompt_mask, batch.completion_mask)
    budget = int(lengths.max()) + 6  # several cuts, some of one row
    out = {}
    for overrides in (["optim.micro_batch_size=4"], ["optim.micro_batch_size=64", f"optim.micro_batch_tokens={budget}"]):
        model = make()
        updater = make_updater(model, shared, *overrides)
        seen = count_micro_steps(updater)
        metrics = updater.update(batch, torch.Generator().manual_seed(5))
        out[len(overrides)] = (metrics, grads(model), seen)
    (m0, g0, _), (m1, g1, cuts) = out[1], out[2]
    assert len(cuts) > 4 and all(lengths[c].sum() <= budget for c in cuts)
    assert rel(g1, g0) <= TOL, rel(g1, g0)
    for k in m0:
        assert abs(m1[k] - m0[k]) <= TOL * max(1.0, abs(m0[k])), (k, m1[k], m0[k])


def test_a_negative_budget_is_refused():
    with pytest.raises(Exception, match="optim.micro_batch_tokens"):
        load_config(None, ["optim.micro_batch_tokens=-1"])
