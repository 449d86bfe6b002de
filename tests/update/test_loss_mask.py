"""The update trains only the model's tokens: an episode's tool tokens (loss_mask 0) stay in the context but take
no part in the loss, the KL or the rollout correction, on the shared-prompt and plain paths alike; batches keep the
mask aligned through selection, concatenation, trimming and checkpoints of in-flight batches."""

from __future__ import annotations

import io

import pytest
import torch

from podsrl.batch import concat_batches
from podsrl.run.producer import ProducedBatch
from tests.update.test_shared_prompt import compare, grads, make_batch, make_updater, rel, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def with_tool_tokens(batch, seed: int = 0):
    """The batch with a span of each completion of 4+ tokens marked as a tool's answer (loss_mask 0), and sampler
    log-probs near the trainer's on the model's tokens."""
    out = batch.select_rows(torch.arange(batch.num_rollouts))
    loss_mask = batch.completion_mask.clone()
    for row, n in enumerate(batch.completion_lengths().tolist()):
        if n >= 4:
            loss_mask[row, 1 + n // 4: 1 + n // 2] = 0.0
    out.loss_mask = loss_mask
    gen = torch.Generator().manual_seed(seed)
    noise = 0.05 * torch.randn(batch.completion_mask.shape, generator=gen)
    out.sampler_logprobs = (trainer_logprobs(batch) + noise) * batch.completion_mask
    return out


def trainer_logprobs(batch) -> torch.Tensor:
    model = tiny_model()
    updater = make_updater(model, True)
    model.train()
    return updater._precompute(model, batch)


def reference():
    ref = tiny_model()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(1)))
    return ref


UPDATES = {  # the loss alone; with a KL term and several passes; with a rollout correction
    "loss": ("optim.micro_batch_size=4",),
    "kl_passes": ("optim.micro_batch_size=3", "optim.epochs=2", "optim.mini_batches=2", "algo.beta=0.1"),
    "correction": ("optim.micro_batch_size=4", "algo.rollout_correction=token_tis", "algo.beta=0.1"),
}


@pytest.mark.parametrize("update", list(UPDATES))
def test_shared_prompt_and_plain_paths_give_the_same_gradient_with_masked_tool_tokens(update):
    batch = with_tool_tokens(make_batch([4, 1, 3, 2], 128, seed=1))
    assert 0 < int(batch.loss_mask.sum()) < int(batch.completion_mask.sum())
    compare(tiny_model, batch, *UPDATES[update], ref=reference())


def one_update(batch, shared: bool, *overrides: str) -> tuple[dict, torch.Tensor]:
    model = tiny_model()
    updater = make_updater(model, shared, "optim.max_grad_norm=0", *overrides, ref=reference())
    metrics = updater.update(batch, torch.Generator().manual_seed(5))
    return metrics, grads(model).clone()


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("update", list(UPDATES))
def test_the_sampler_log_probs_of_masked_tokens_change_nothing(update, shared):
    """The sampler's log-probs are PPO's old log-probs (several passes) or the correction's denominator: on a
    tool's tokens they are whatever the tool's text got, and must not reach the gradient."""
    batch = with_tool_tokens(make_batch([3, 2, 3], 128, seed=4))
    masked = (batch.completion_mask > 0) & (batch.loss_mask == 0)
    changed = batch.select_rows(torch.arange(batch.num_rollouts))
    changed.sampler_logprobs = batch.sampler_logprobs.masked_fill(masked, -30.0)
    m0, g0 = one_update(batch, shared, *UPDATES[update])
    m1, g1 = one_update(changed, shared, *UPDATES[update])
    # equal on the CPU; CUDA's atomic adds may reorder a sum between two runs of one batch
    assert rel(g1, g0) <= 1e-6, rel(g1, g0)
    assert m0.keys() == m1.keys() and all(abs(m1[k] - m0[k]) <= 1e-5 * max(1.0, abs(m0[k])) for k in m0)
    # the mask does matter: training the tool's tokens too gives another gradient
    unmasked = batch.select_rows(torch.arange(batch.num_rollouts))
    unmasked.loss_mask = None
    assert rel(one_update(unmasked, shared, *UPDATES[update])[1], g0) > 1e-3


def test_selection_concatenation_trimming_and_checkpoints_keep_the_mask_aligned():
    masked = with_tool_tokens(make_batch([3, 2], 128, seed=2, max_len=10))
    plain = make_batch([2, 1], 128, seed=3, max_len=6)
    rows = torch.tensor([4, 0, 2])
    picked = masked.select_rows(rows)
    assert torch.equal(picked.loss_mask, masked.loss_mask[rows])
    trimmed = masked.select_rows(masked.completion_lengths() < 10).trim_padding()
    assert trimmed.loss_mask.shape == trimmed.completion_mask.shape
    assert torch.equal(trimmed.loss_mask, masked.loss_mask[masked.completion_lengths() < 10][:, :trimmed.
                                                                                              completion_mask.shape[1]])
    both = concat_batches([plain, masked], pad_token_id=0, disjoint=True)
    assert both.loss_mask.shape == both.completion_mask.shape
    # a batch without a loss mask trains every token it holds; the other keeps its own
    assert torch.equal(both.loss_mask[:3, :6], plain.completion_mask) and not bool(both.loss_mask[:3, 6:].any())
    assert torch.equal(both.loss_mask[3:], masked.loss_mask)
    assert concat_batches([plain, plain], pad_token_id=0).loss_mask is None
    produced = ProducedBatch(kept=masked, metrics={}, generated_rollouts=5, generated_tokens=20)
    buffer = io.BytesIO()
    torch.save(produced.state_dict(), buffer)
    buffer.seek(0)
    restored = ProducedBatch.from_state(torch.load(buffer, weights_only=True))
    assert torch.equal(restored.kept.loss_mask, masked.loss_mask)
