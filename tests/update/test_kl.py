"""The KL term of the update with TRL's ratio weighting (algo.kl_ratio_weighted, TRL's use_bias_correction_kl): on
one pass the ratio is 1, so the loss is unchanged, but its gradient adds the score-function term k3 * grad log pi;
TRL's name sets the key."""

from __future__ import annotations

import pytest
import torch

from podsrl.algo.loss import k3_kl
from podsrl.config import load_config
from podsrl.update.plain import plain_logprobs
from tests.conftest import device_under_test
from tests.update.test_shared_prompt import grads, make_batch, make_updater, rel, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

BETA = 0.1
TEMPERATURE = 0.8  # make_updater's rollout.temperature


def reference_model():
    ref = tiny_model()
    torch.manual_seed(11)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return ref.to(device_under_test())


def kl_update(batch, ref, weighted: bool) -> tuple[dict, torch.Tensor]:
    """One pass of the plain path in float32 (the expected gradient below is computed without autocast)."""
    model = tiny_model()
    updater = make_updater(model, False, f"algo.beta={BETA}", f"algo.kl_ratio_weighted={str(weighted).lower()}",
                           "algo.rollout_correction=none", "model.compute_dtype=float32", "optim.max_grad_norm=0",
                           "optim.micro_batch_size=16", ref=ref)
    metrics = updater.update(batch, torch.Generator().manual_seed(5))
    return metrics, grads(model).clone()


def test_ratio_weighting_adds_the_score_function_term_to_the_kl_gradient():
    """With zero advantages the gradient is the KL term's alone. d/dtheta [k3 * pi / pi_old] at pi = pi_old is
    grad k3 + k3 * grad log pi: the weighted run's gradient is the unweighted one plus beta * k3 * grad log pi under
    the token-mean aggregation, which is computed here from the plain forward."""
    device = device_under_test()
    batch = make_batch([4, 1, 3, 2], 128, seed=1)
    batch.advantages.zero_()
    ref = reference_model()
    plain_metrics, plain_grad = kl_update(batch, ref, weighted=False)
    weighted_metrics, weighted_grad = kl_update(batch, ref, weighted=True)
    assert weighted_metrics["kl"] == pytest.approx(plain_metrics["kl"], rel=1e-6)  # the ratio's value is 1
    assert weighted_metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-6)

    model = tiny_model().to(device)
    rows = torch.arange(batch.num_rollouts)
    width = batch.completion_mask.shape[1]
    logp, _ = plain_logprobs(model, batch, rows, width, device, TEMPERATURE, 1024)
    with torch.no_grad():
        ref_logp, _ = plain_logprobs(ref, batch, rows, width, device, TEMPERATURE, 1024)
    mask = batch.completion_mask.to(device)
    score_term = (BETA * mask / mask.sum() * k3_kl(logp.detach(), ref_logp) * logp).sum()
    score_term.backward()
    expected = grads(model)
    print(f"score term: rel. error {rel(weighted_grad - plain_grad, expected):.2e}, share of the gradient "
          f"{rel(weighted_grad, plain_grad):.2e}")
    assert rel(weighted_grad - plain_grad, expected) <= 1e-4, rel(weighted_grad - plain_grad, expected)
    assert rel(weighted_grad, plain_grad) > 1e-3  # the term is not negligible on this batch


def test_trls_name_sets_the_key():
    assert load_config(None, ["use_bias_correction_kl=true"]).algo.kl_ratio_weighted is True
    assert load_config(None, []).algo.kl_ratio_weighted is False
