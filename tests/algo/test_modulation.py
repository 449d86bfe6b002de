import math

import pytest
import torch

from podsrl.algo import modulation
from podsrl.config import load_config
from podsrl.errors import ConfigError
from podsrl.methods.dynamo import DynamoConfig
from podsrl.models.logprobs import token_entropy

EPS_LOW, EPS_HIGH = 0.2, 0.28
# the kernel takes every setting; a test's unnamed ones are the dynamo section's defaults
SETTINGS = {k: getattr(DynamoConfig(), k) for k in ("lambda_min", "gamma", "tau", "mu_max", "stabilize", "compensate")}


def dynamo_modulation(*tensors_and_clip, **settings):
    return modulation.dynamo_modulation(*tensors_and_clip, **{**SETTINGS, **settings})


def loop_reference(adv, log_ratio, logp, ent, mask, lam=0.6, gamma=50.0, tau=0.99, mu=1.2):
    """The docs/methods.md#dynamo formulas token by token with Python floats."""
    b_n, t_n = len(mask), len(mask[0])
    dh = [[0.0] * t_n for _ in range(b_n)]
    for b in range(b_n):
        valid = [t for t in range(t_n) if mask[b][t]]
        us = {t: math.exp(logp[b][t]) * (logp[b][t] + ent[b][t]) for t in valid}
        u_mean = sum(us.values()) / len(valid) if valid else 0.0
        for t in valid:
            a, rho = adv[b][t], math.exp(log_ratio[b][t])
            ind = (a > 0 and rho <= 1 + EPS_HIGH) or (a < 0 and rho >= 1 - EPS_LOW)
            dh[b][t] = abs(-(rho * a if ind else 0.0) * (us[t] - u_mean))
    pairs = [(b, t) for b in range(b_n) for t in range(t_n) if mask[b][t]]
    dmax = max(dh[b][t] for b, t in pairs)
    hs = [ent[b][t] for b, t in pairs]
    h_min, h_max = min(hs), max(hs)
    stab = [[1.0] * t_n for _ in range(b_n)]
    comp = [[1.0] * t_n for _ in range(b_n)]
    for b, t in pairs:
        x = dh[b][t] / (dmax + 1e-8)
        stab[b][t] = lam + (1 - lam) / (1 + math.exp(gamma * (x - tau)))
        if adv[b][t] > 0:
            comp[b][t] = 1 + (mu - 1) * (h_max - ent[b][t]) / (h_max - h_min + 1e-8)
    return torch.tensor(stab, dtype=torch.float64), torch.tensor(comp, dtype=torch.float64)


def random_case(seed, b=4, t=7, v=11):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=gen, dtype=torch.float64) * 2
    tokens = torch.randint(0, v, (b, t), generator=gen)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    ent = token_entropy(logits).double()
    adv = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, t).clone()
    adv[0] = 0.0
    # ratios on both sides of both clip edges
    log_ratio = torch.log(torch.empty(b, t, dtype=torch.float64).uniform_(0.6, 1.5, generator=gen))
    mask = torch.rand(b, t, generator=gen) < 0.8
    mask[:, 0] = True
    return adv, log_ratio, logp, ent, mask


@pytest.mark.parametrize("seed", range(8))
def test_matches_loop_reference(seed):
    adv, log_ratio, logp, ent, mask = random_case(seed)
    factor, metrics = dynamo_modulation(adv, log_ratio, logp, ent, mask, EPS_LOW, EPS_HIGH)
    stab, comp = loop_reference(adv.tolist(), log_ratio.tolist(), logp.tolist(), ent.tolist(), mask.tolist())
    torch.testing.assert_close(factor, stab * comp, rtol=1e-9, atol=1e-9)
    v = mask
    assert metrics["modulation/stab_mean"] == pytest.approx(float(stab[v].mean()))
    assert metrics["modulation/stab_min"] == pytest.approx(float(stab[v].min()))
    assert metrics["modulation/comp_max"] == pytest.approx(float(comp[v].max()))
    assert metrics["modulation/comp_min"] == pytest.approx(1.0)  # A ≤ 0 rows are valid and get exactly 1
    # non-default parameters reach the formulas
    factor, _ = dynamo_modulation(adv, log_ratio, logp, ent, mask, EPS_LOW, EPS_HIGH, lambda_min=0.3, gamma=10.0,
                                  tau=0.5, mu_max=1.5)
    stab, comp = loop_reference(
        adv.tolist(), log_ratio.tolist(), logp.tolist(), ent.tolist(), mask.tolist(), 0.3, 10.0, 0.5, 1.5
    )
    torch.testing.assert_close(factor, stab * comp, rtol=1e-9, atol=1e-9)


def test_hand_computed_two_tokens():
    # one sequence, A = 1, ρ = 1, two tokens: logπ = log 0.5 and log 0.25, entropies 1.0 and 2.0
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ent = torch.tensor([[1.0, 2.0]])
    factor, m = dynamo_modulation(torch.ones(1, 2), torch.zeros(1, 2), logp, ent, torch.ones(1, 2), 0.2, 0.2)
    # u = (0.5(−0.693+1), 0.25(−1.386+2)) = (0.1534, 0.1534): equal, so ΔH = 0, x = 0
    # and β_stab = 0.6 + 0.4σ(49.5)
    stab0 = 0.6 + 0.4 / (1 + math.exp(50 * (0 - 0.99)))
    # β_comp: the lowest-entropy token gets μ_max (up to the 1e-8), the highest gets 1
    assert factor[0, 0].item() == pytest.approx(stab0 * (1 + 0.2 * 1 / (1 + 1e-8)), rel=1e-6)
    assert factor[0, 1].item() == pytest.approx(stab0, rel=1e-6)
    # now make u differ: the token with the larger |ΔH| has x = 1 and gets the strongest damping
    logp = torch.tensor([[math.log(0.9), math.log(0.1)]])
    factor, m = dynamo_modulation(
        torch.ones(1, 2), torch.zeros(1, 2), logp, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2
    )
    x1 = 1 / (1 + 1e-8)
    assert factor.tolist()[0] == pytest.approx([0.6 + 0.4 / (1 + math.exp(50 * (x1 - 0.99)))] * 2, rel=1e-6)
    assert m["modulation/stab_max"] == pytest.approx(0.6 + 0.4 / (1 + math.exp(50 * (x1 - 0.99))), rel=1e-6)


def test_clipped_tokens_carry_no_entropy_change():
    # A > 0 with ρ above 1+ε_high and A < 0 with ρ below 1−ε_low: I = 0, ξ = 0, so x = 0 and β_stab ≈ 1
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    log_ratio = torch.log(torch.tensor([[1.5, 1.5, 1.0], [0.5, 0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.9, 0.1, 0.5], [0.9, 0.1, 0.5]]))
    ent = torch.ones(2, 3)
    factor, _ = dynamo_modulation(
        adv, log_ratio, logp, ent, torch.ones(2, 3), EPS_LOW, EPS_HIGH, compensate=False
    )
    near_one = 0.6 + 0.4 / (1 + math.exp(-50 * 0.99))
    assert factor[1].tolist() == pytest.approx([near_one] * 3)  # every token of row 1 clipped
    assert factor[0, :2].tolist() == pytest.approx([near_one] * 2)  # clipped tokens of row 0
    # only token (0, 2) is unclipped, so it alone defines the max: x = 1 there
    assert factor[0, 2].item() == pytest.approx(0.6 + 0.4 / (1 + math.exp(50 * (1 - 0.99))), rel=1e-6)


def test_no_compensation_for_non_positive_advantages():
    adv = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])
    ent = torch.tensor([[0.1, 3.0], [0.1, 3.0]])
    factor, m = dynamo_modulation(
        adv, torch.zeros(2, 2), -torch.ones(2, 2), ent, torch.ones(2, 2), 0.2, 0.2, stabilize=False
    )
    assert factor.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert m["modulation/comp_max"] == 1.0


def test_equal_entropies_give_no_boost():
    adv = torch.ones(3, 4)
    for h in (0.0, 1e-3, 5.0):
        factor, m = dynamo_modulation(
            adv,
            torch.zeros(3, 4),
            -torch.ones(3, 4),
            torch.full((3, 4), h),
            torch.ones(3, 4),
            0.2,
            0.2,
            stabilize=False,
        )
        assert torch.isfinite(factor).all()
        assert factor.tolist() == [[1.0] * 4] * 3  # (μ−1)·0/(0 + 1e-8) = 0
        assert m["modulation/comp_mean"] == 1.0
    # a tiny spread still stays inside [1, μ_max)
    ent = torch.tensor([[1.0, 1.0 + 1e-6]]).double()
    factor, _ = dynamo_modulation(
        torch.ones(1, 2),
        torch.zeros(1, 2),
        -torch.ones(1, 2),
        ent,
        torch.ones(1, 2),
        0.2,
        0.2,
        stabilize=False,
    )
    assert 1.0 <= float(factor.min()) and float(factor.max()) < 1.2


def test_masked_tokens_are_ignored():
    adv, log_ratio, logp, ent, mask = random_case(3)
    factor, metrics = dynamo_modulation(adv, log_ratio, logp, ent, mask, EPS_LOW, EPS_HIGH)
    assert (factor[~mask] == 1).all()
    # garbage at padded positions (huge entropy, extreme log-probs and ratios) changes nothing
    junk = ~mask
    ent2, logp2, lr2 = ent.clone(), logp.clone(), log_ratio.clone()
    ent2[junk], logp2[junk], lr2[junk] = 1e6, 0.0, 5.0
    factor2, metrics2 = dynamo_modulation(adv, lr2, logp2, ent2, mask, EPS_LOW, EPS_HIGH)
    torch.testing.assert_close(factor2, factor)
    assert metrics2 == pytest.approx(metrics)
    # an empty mask gives ones and finite metrics
    empty = torch.zeros_like(mask)
    factor3, metrics3 = dynamo_modulation(adv, log_ratio, logp, ent, empty, EPS_LOW, EPS_HIGH)
    assert (factor3 == 1).all() and all(v == 1.0 for v in metrics3.values())


def test_mean_of_u_is_per_sequence():
    # each row has constant u, but rows differ: centring per sequence gives ΔH = 0 everywhere
    logp = torch.log(torch.tensor([[0.9] * 3, [0.2] * 3]))
    factor, _ = dynamo_modulation(
        torch.ones(2, 3),
        torch.zeros(2, 3),
        logp,
        torch.ones(2, 3),
        torch.ones(2, 3),
        0.2,
        0.2,
        compensate=False,
    )
    assert torch.allclose(factor, torch.full((2, 3), 0.6 + 0.4 / (1 + math.exp(-50 * 0.99))))


def test_factor_has_no_grad_and_broadcasts_sequence_advantages():
    adv, log_ratio, logp, ent, mask = random_case(5)
    leaves = [x.clone().requires_grad_(True) for x in (adv, log_ratio, logp, ent)]
    factor, _ = dynamo_modulation(*leaves, mask, EPS_LOW, EPS_HIGH)
    assert not factor.requires_grad and factor.grad_fn is None
    factor_seq, _ = dynamo_modulation(adv[:, 0], log_ratio, logp, ent, mask, EPS_LOW, EPS_HIGH)
    torch.testing.assert_close(factor_seq, factor.detach())
    # float32 inputs give a float32 factor; bf16 advantages are upcast
    f32, _ = dynamo_modulation(
        adv.float(), log_ratio.float(), logp.float(), ent.float(), mask, EPS_LOW, EPS_HIGH
    )
    assert f32.dtype == torch.float32
    torch.testing.assert_close(f32.double(), factor.detach(), rtol=1e-4, atol=1e-4)
    assert dynamo_modulation(adv.bfloat16(), log_ratio, logp, ent, mask, 0.2, 0.2)[0].dtype == torch.float32


def test_stabilize_and_compensate_switches():
    adv, log_ratio, logp, ent, mask = random_case(7)
    both, _ = dynamo_modulation(adv, log_ratio, logp, ent, mask, EPS_LOW, EPS_HIGH)
    stab, _ = dynamo_modulation(adv, log_ratio, logp, ent, mask, EPS_LOW, EPS_HIGH, compensate=False)
    comp, m = dynamo_modulation(adv, log_ratio, logp, ent, mask, EPS_LOW, EPS_HIGH, stabilize=False)
    off, _ = dynamo_modulation(
        adv, log_ratio, logp, ent, mask, EPS_LOW, EPS_HIGH, stabilize=False, compensate=False
    )
    torch.testing.assert_close(both, stab * comp)
    assert (stab <= 1).all() and (stab >= 0.6).all() and (stab < 0.99).any()
    assert (comp >= 1).all() and (comp > 1.01).any()
    assert m["modulation/stab_min"] == 1.0 and m["modulation/stab_max"] == 1.0
    assert (off == 1).all()


@pytest.mark.parametrize(
    ("override", "field"),
    [("dynamo.lambda_min=1.5", "dynamo.lambda_min"), ("dynamo.mu_max=0.5", "dynamo.mu_max"),
     ("dynamo.gamma=-1", "dynamo.gamma")],
)
def test_bad_parameters_are_refused_at_load(override, field):
    # the bounds live with the dynamo section's checks, not in the kernel
    with pytest.raises(ConfigError, match=field):
        load_config(None, ["method=dynamo", override])


def test_token_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, 17, generator=gen, dtype=torch.float64) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    for chunk in (None, 1, 3, 64):
        torch.testing.assert_close(
            token_entropy(logits, chunk_size=chunk).double(), expected, rtol=1e-5, atol=1e-5
        )
    # large logits stay finite; a one-hot distribution has entropy 0; −inf logits (banned tokens) contribute 0
    big = logits * 1e4
    assert torch.isfinite(token_entropy(big)).all()
    masked = logits.clone()
    masked[..., 5:] = -torch.inf
    torch.testing.assert_close(
        token_entropy(masked).double(),
        torch.distributions.Categorical(logits=logits[..., :5]).entropy(),
        rtol=1e-5,
        atol=1e-5,
    )
    # uniform over V gives log V; bf16 input is upcast
    assert torch.allclose(
        token_entropy(torch.zeros(1, 2, 17, dtype=torch.bfloat16)), torch.full((1, 2), math.log(17))
    )
    # differentiable (the caller detaches where it must)
    leaf = logits.clone().requires_grad_(True)
    token_entropy(leaf, chunk_size=4).sum().backward()
    assert torch.isfinite(leaf.grad).all() and leaf.grad.abs().sum() > 0
    assert token_entropy(torch.zeros(2, 0, 5)).shape == (2, 0)
