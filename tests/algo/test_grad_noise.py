"""The split-half gradient-noise estimate: the halves add up to the plain gradient, the logged value matches the
brute-force per-group gradients, the estimator is unbiased (over splits, and for the variance of a sum of i.i.d.
group gradients), the update is unchanged, and a trainer run logs it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from podsrl.algo.grad_noise import SplitHalfProbe, expected_noise_var, make_probe, split_halves, split_seed
from podsrl.algo.loss import aggregation_stats
from podsrl.config import load_config
from podsrl.config.facts import run_facts
from podsrl.methods import METHODS, offline_context
from podsrl.reporting.tracking import read_metrics
from podsrl.run.trainer import Trainer
from podsrl.update import PolicyUpdater, UpdateSettings
from tests.conftest import device_under_test, tiny_overrides
from tests.distributed.test_distributed import make_batch, make_model

SIZES = [5, 1, 3, 2, 4]  # odd K = 5 and groups of unequal size


def setup(*overrides: str):
    # float32 compute on every device (`auto` is bfloat16 on CUDA): the gradients are checked against exact formulas
    cfg = load_config(None, ["optim.max_grad_norm=0", "model.compute_dtype=float32", "optim.micro_batch_size=256",
                             *overrides])  # 256: auto as a CPU run decides it
    kept, _ = METHODS[cfg.method](cfg).select(make_batch(SIZES, seed=3), offline_context(cfg, torch.Generator().manual_seed(1)))
    model = make_model().to(device_under_test())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # params move by exactly -g
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return cfg, kept.trim_padding(), model, PolicyUpdater(model, optimizer, scheduler, UpdateSettings.of(cfg),
                                                                 run_facts(cfg, device_under_test()))


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def flat_grad(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


def group_contributions(updater, model, batch) -> torch.Tensor:
    """[K, D]: each group's gradient alone, with the token weights normalised over the whole mini-batch."""
    rows = torch.arange(batch.num_rollouts)
    stats = aggregation_stats(batch.completion_mask, updater.cfg.max_new_tokens)
    out = []
    for k in range(batch.num_groups):
        model.zero_grad(set_to_none=True)
        updater._micro_step(batch, rows[batch.group_index == k], stats, None, None)
        out.append(flat_grad(model).double())
    model.zero_grad(set_to_none=True)
    return torch.stack(out)


def split_value(c: torch.Tensor, in_group_a: torch.Tensor) -> float:
    a, b = int(in_group_a.sum()), int((~in_group_a).sum())
    return float(a * b * (c[in_group_a].sum(0) / a - c[~in_group_a].sum(0) / b).pow(2).sum())


def test_halves_add_up_and_the_logged_value_matches_per_group_gradients():
    cfg, batch, model, updater = setup("log.grad_noise=true", "optim.micro_batch_size=2")
    c = group_contributions(updater, model, batch)
    gen = torch.Generator().manual_seed(5)
    in_a, a, b = split_halves(batch.group_index, split_seed(gen))
    group_in_a = torch.tensor([bool(in_a[batch.group_index == k].all()) for k in range(batch.num_groups)])
    assert (a, b) == (2, 3) and int(group_in_a.sum()) == 2

    snapshots = []
    original = SplitHalfProbe.snapshot

    def spy(self):
        original(self)
        snapshots.append(torch.cat([t.reshape(-1) for t in self.first]).double())

    before = flat(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SplitHalfProbe, "snapshot", spy)
        metrics = updater.update(batch, gen)
    g = (before - flat(model)).double()
    torch.testing.assert_close(g, c.sum(0), rtol=1e-4, atol=1e-7)  # g = sum of the per-group gradients
    torch.testing.assert_close(snapshots[0], c[group_in_a].sum(0), rtol=1e-4, atol=1e-7)  # g_A
    torch.testing.assert_close(g - snapshots[0], c[~group_in_a].sum(0), rtol=1e-4, atol=1e-7)  # g_B = g - g_A
    assert metrics["grad/noise_var"] == pytest.approx(split_value(c, group_in_a), rel=1e-4)
    assert metrics["grad/signal"] == pytest.approx(float(c.sum(0).pow(2).sum()), rel=1e-4)
    assert metrics["grad/noise_to_signal"] == pytest.approx(metrics["grad/noise_var"] / metrics["grad/signal"])


def probe_value(c: torch.Tensor, group_index: torch.Tensor, seed: int) -> float:
    """The probe's estimate when the per-group gradients are the rows of c (one flat parameter)."""
    param = torch.nn.Parameter(torch.zeros(c.shape[1], dtype=torch.float64))
    probe = make_probe([param], group_index, torch.Generator().manual_seed(seed))
    groups_a = group_index[probe.in_a].unique()
    param.grad = c[groups_a].sum(0).clone()
    probe.snapshot()
    param.grad = c.sum(0).clone()
    return probe.metrics()["grad/noise_var"]


@pytest.mark.parametrize("k", [4, 5])
def test_mean_over_splits_is_k_times_the_sample_variance(k):
    c = torch.randn(k, 6, generator=torch.Generator().manual_seed(k), dtype=torch.float64) + 3.0
    exact = expected_noise_var(c)
    enumerated = [split_value(c, torch.tensor([j in a for j in range(k)]))
                  for a in itertools.combinations(range(k), k // 2)]
    assert sum(enumerated) / len(enumerated) == pytest.approx(exact, rel=1e-12)
    group_index = torch.repeat_interleave(torch.arange(k), torch.tensor([1 + j % 3 for j in range(k)]))
    draws = [probe_value(c, group_index, seed) for seed in range(3000)]
    assert sum(draws) / len(draws) == pytest.approx(exact, rel=0.03)
    assert min(draws) == pytest.approx(min(enumerated)) and max(draws) == pytest.approx(max(enumerated))


def test_unbiased_for_the_variance_of_a_sum_of_iid_group_gradients():
    # g = sum of K i.i.d. group gradients with a large mean: tr Cov(g) = K tr Sigma, whatever the mean.
    k, std = 5, torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    group_index = torch.arange(k)
    values = [probe_value(10.0 + std * torch.randn(k, 3, generator=gen, dtype=torch.float64), group_index, trial)
              for trial in range(4000)]
    assert sum(values) / len(values) == pytest.approx(k * float(std.pow(2).sum()), rel=0.05)


def test_one_group_gives_no_estimate():
    assert split_halves(torch.zeros(4, dtype=torch.long), 0) is None
    _, batch, _, updater = setup("log.grad_noise=true")
    one = batch.select_rows(batch.group_index == 0)
    assert "grad/noise_var" not in updater.update(one, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("extra", [[], ["optim.mini_batches=2", "optim.epochs=2"]])
def test_enabling_it_leaves_the_update_and_the_generator_unchanged(extra):
    runs = []
    for on in (False, True):
        # SGD: the weights move by the gradient itself (Adam's first step is sign-like and would amplify the
        # rounding of near-zero gradients that the changed summation order brings)
        _, batch, model, updater = setup(f"log.grad_noise={str(on).lower()}", "optim.micro_batch_size=3", *extra)
        gen = torch.Generator().manual_seed(9)
        metrics = updater.update(batch, gen)
        runs.append((flat(model), gen.get_state(), metrics))
    (w_off, rng_off, m_off), (w_on, rng_on, m_on) = runs
    torch.testing.assert_close(w_on, w_off, rtol=0, atol=1e-6)
    assert torch.equal(rng_on, rng_off)
    assert "grad/noise_var" in m_on and not any(k.startswith("grad/") for k in m_off)
    assert m_on["loss"] == pytest.approx(m_off["loss"], rel=1e-5, abs=1e-7)


def test_a_trainer_run_logs_the_grad_metrics(tmp_path, warmup_cache):
    ones = Path(__file__).parents[1] / "fixtures" / "rewards_ones.py"  # graded, spread rewards: nonzero gradients
    extra = {"log.grad_noise": "true", "rewards": f"[{{name: even, function: '{ones}:even_digit_share'}}]"}
    cfg = load_config("podsrl/configs/grpo.yaml", tiny_overrides(tmp_path / "run", warmup_cache, **extra))
    Trainer(cfg).train()
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["grad/noise_var"] > 0 and r["grad/signal"] > 0
        assert r["grad/noise_to_signal"] == pytest.approx(r["grad/noise_var"] / r["grad/signal"])
