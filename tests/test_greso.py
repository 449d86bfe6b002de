"""GRESO pre-rollout skipping (METHODS.md §6): skip probabilities, decisions, adaptation, refill estimate."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from podsrl.algo.greso import (
    KEPT,
    SKIPPED_EASY,
    SKIPPED_HARD,
    adapt_exploration,
    refill_estimate,
    skip_decisions,
    skip_probabilities,
)


def t(xs, dtype=torch.long):
    return torch.tensor(xs, dtype=dtype)


# §6(c): A no history, B [mixed, all-correct, all-correct], C [all-wrong x3], D [all-correct, mixed],
# E [all-correct x8] -> streaks (easy, hard)
EASY, HARD = t([0, 2, 0, 0, 8]), t([0, 0, 3, 0, 0])


def test_spec_example_probabilities():
    easy_p, hard_p = skip_probabilities(EASY, HARD, 0.5, 0.5)
    skip = torch.where(EASY > 0, easy_p, hard_p)
    assert skip.tolist() == pytest.approx([0.0, 0.75, 0.875, 0.0, 0.99])


def test_spec_example_decisions():
    # u_B = 0.8 keeps B (0.8 >= 0.75); u_C = 0.5 skips C (0.5 < 0.875); a zero streak is never skipped
    uniforms = torch.tensor([[0.0, 0.0], [0.8, 0.0], [0.9, 0.5], [0.0, 0.0], [0.985, 0.0]])
    codes = skip_decisions(EASY, HARD, 0.5, 0.5, uniforms)
    assert codes.tolist() == [KEPT, KEPT, SKIPPED_HARD, KEPT, SKIPPED_EASY]
    # the easy test comes first: a prompt skipped as easy is not counted as hard
    both = skip_decisions(t([1]), t([1]), 0.5, 0.5, torch.tensor([[0.1, 0.1]]))
    assert both.tolist() == [SKIPPED_EASY]


def test_spec_example_adaptation():
    # epoch 1, 100 groups: 20 all-wrong (>= 2T/3 = 0.1667) -> p_hard down; 5 all-correct (< T/3) -> p_easy up
    target = 0.25
    assert adapt_exploration(0.5, 20 / 100, 2 * target / 3) == 0.49
    assert adapt_exploration(0.5, 5 / 100, target / 3) == 0.51
    # clamped to [0.05, 0.95]
    assert adapt_exploration(0.05, 1.0, 0.1) == 0.05
    assert adapt_exploration(0.95, 0.0, 0.1) == 0.95
    p = 0.5
    for _ in range(100):
        p = adapt_exploration(p, 1.0, 0.1)
    assert p == 0.05


def test_refill_estimate():
    # 30 groups missing at zvr 0.5: 30 / 0.5 * 1.25 = 75, within [8, 48] -> 48
    assert refill_estimate(30, 0.5, lowest=8, highest=48) == 48
    assert refill_estimate(10, 0.5, lowest=8, highest=48) == 25
    assert refill_estimate(2, 0.0, lowest=8, highest=48) == 8
    # zvr = 1 divides by zero in the reference: the largest draw
    assert refill_estimate(5, 1.0, lowest=8, highest=48) == 48
    assert refill_estimate(5, 1.0) == 7
    assert refill_estimate(0, 0.3, lowest=8) == 0


@settings(max_examples=100, deadline=None)
@given(easy=st.lists(st.integers(0, 10), min_size=1, max_size=30), seed=st.integers(0, 2**31),
       p_easy=st.floats(0.05, 0.95), p_hard=st.floats(0.05, 0.95))
def test_decisions_deterministic_and_consistent(easy, seed, p_easy, p_hard):
    easy_t = torch.tensor(easy)
    hard_t = torch.tensor([0 if e else (i % 4) for i, e in enumerate(easy)])  # streaks exclude each other
    draws = torch.rand((len(easy), 2), generator=torch.Generator().manual_seed(seed))
    a = skip_decisions(easy_t, hard_t, p_easy, p_hard, draws)
    b = skip_decisions(easy_t, hard_t, p_easy, p_hard, draws.clone())
    assert torch.equal(a, b)
    never = (easy_t == 0) & (hard_t == 0)
    assert (a[never] == KEPT).all()
    assert ((a != SKIPPED_EASY) | (easy_t > 0)).all() and ((a != SKIPPED_HARD) | (hard_t > 0)).all()
    easy_p, hard_p = skip_probabilities(easy_t, hard_t, p_easy, p_hard)
    assert float(easy_p.max()) <= 0.99 + 1e-12 and float(hard_p.max()) <= 0.99 + 1e-12
