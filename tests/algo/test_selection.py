"""PODS down-sampling rules (algo/selection.py): brute-force optimality, documented tie-breaks, unequal groups,
metrics."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from podsrl.algo.group_stats import zero_variance_groups
from podsrl.algo.selection import (
    SELECTION_RULES,
    _ends,
    _keep_extremes,
    max_reward_subset,
    max_variance_subset,
    pack_groups,
    random_subset,
    select_rollouts,
    selection_metrics,
)
from podsrl.config import load_config
from podsrl.errors import ConfigError


def sample_var(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


def brute_max_var(xs: list[float], m: int) -> float:
    return max(sample_var(list(c)) for c in itertools.combinations(xs, m))


def reference_rows(xs: list[Fraction], m: int) -> list[int]:
    """The documented rule, written slowly and exactly: positions kept within one group."""
    n = len(xs)
    if n <= m:
        return list(range(n))
    order = sorted(range(n), key=lambda i: -xs[i])  # Python's sort is stable
    s = [xs[i] for i in order]

    def var(vals: list[Fraction]) -> Fraction:
        mean = sum(vals, Fraction(0)) / m
        return sum(((v - mean) ** 2 for v in vals), Fraction(0)) / max(m - 1, 1)

    cands = [s[:k] + s[n - (m - k) :] for k in range(m + 1)]
    vs = [var(c) for c in cands]
    best = max(vs)
    k = m if vs[m] == best else vs.index(best)
    need = Counter(cands[k])
    kept = []
    for i in range(n):  # earliest rows of each chosen value
        if need[xs[i]] > 0:
            need[xs[i]] -= 1
            kept.append(i)
    return kept


def kept_variance_ok(values: list[float], keep: list[bool], m: int, rel_tol: float = 1e-9) -> None:
    kept = [v for v, k in zip(values, keep) if k]
    if len(values) <= m:
        assert len(kept) == len(values)
        return
    assert len(kept) == m
    best = brute_max_var(values, m)
    assert math.isclose(sample_var(kept), best, rel_tol=rel_tol, abs_tol=1e-12), (values, m, kept, best)


def random_rewards(rng: random.Random, n: int, kind: str) -> list[float]:
    if kind == "binary":
        return [float(rng.random() < rng.random()) for _ in range(n)]
    if kind == "ties":
        return [float(rng.choice([0, 0.5, 1, 1.25])) for _ in range(n)]
    return [rng.uniform(-2, 3) for _ in range(n)]


# ---------------------------------------------------------------- max variance: optimality and exact rule


@pytest.mark.parametrize("kind", ["binary", "ties", "continuous"])
def test_max_variance_matches_brute_force_all_m(kind: str) -> None:
    rng = random.Random({"binary": 1, "ties": 2, "continuous": 3}[kind])
    for n in range(2, 13):
        for _ in range(3 if n > 9 else 6):
            values = random_rewards(rng, n, kind)
            for m in range(2, n + 1):
                r = torch.tensor([values], dtype=torch.float64)
                keep = max_variance_subset(r, torch.ones(1, n, dtype=torch.bool), m)
                kept_variance_ok(values, keep[0].tolist(), m)
                # float32 input: optimal for the rounded values, up to the dtype-aware tie tolerance
                r32 = r.float()
                keep = max_variance_subset(r32, torch.ones(1, n, dtype=torch.bool), m)
                kept_variance_ok(r32[0].tolist(), keep[0].tolist(), m, rel_tol=1e-5)


@pytest.mark.parametrize("kind", ["binary", "ties", "decimal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_variance_rows_follow_documented_rule(kind: str, dtype: torch.dtype) -> None:
    # The reference works on exact rationals. "decimal" rewards (one decimal place) are not exact in binary:
    # their intended ties must survive rounding, which is what the tie tolerance is for.
    rng = random.Random({"binary": 7, "ties": 8, "decimal": 9}[kind])
    for _ in range(100):
        n = rng.randint(1, 10)
        if kind == "decimal":
            exact = [Fraction(rng.randint(0, 9), 10) for _ in range(n)]
        else:
            exact = [Fraction(v) for v in random_rewards(rng, n, kind)]
        r = torch.tensor([[float(v) for v in exact]], dtype=dtype)
        for m in range(1, n + 1):
            keep = max_variance_subset(r, torch.ones(1, n, dtype=torch.bool), m)
            got = keep[0].nonzero().flatten().tolist()
            assert got == reference_rows(exact, m), (exact, m)


@pytest.mark.parametrize(
    ("values", "m", "rows"),
    [
        ([1, 1, 0, 0], 2, [0, 2]),  # k=1 is the unique best: the first 1 and the first 0
        ([0, 1, 0, 1], 2, [0, 1]),
        ([5, 5, 5, 5, 5], 3, [0, 1, 2]),  # all equal: every k ties, k=m = the first m rows
        ([1, 1, 1, 0], 2, [0, 3]),
        ([0, 0, 0, 1], 3, [0, 1, 3]),  # k=3 ties the best ({1,0,0}) and wins over smaller k
        ([1, 1, 0, 0], 3, [0, 1, 2]),  # {1,1,0} and {1,0,0} tie: k=m keeps two 1s
        ([3, 2, 1, 0], 3, [0, 2, 3]),  # k=1 and k=2 tie (variance 7/3): the smallest k wins
        ([0.3, 0.2, 0.1, 0.0], 3, [0, 2, 3]),  # same tie under rounding noise
        ([0, 1, 0, 0, 1, 0, 1, 0], 4, [0, 1, 2, 4]),  # two 1s and two 0s, earliest of each
        ([0.6, 0.6, 0.2, 0.2], 3, [0, 1, 2]),  # decimal tie that rounding splits: k=m still wins
        ([0.1, 0.6, 0.0, 0.7], 3, [0, 2, 3]),  # {.7,.6,0} and {.7,.1,0} tie: the smallest k wins
        ([2, 7, 4], 1, [1]),  # m=1: all variances are 0, so the top-1 set
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_variance_hand_cases(values: list[float], m: int, rows: list[int], dtype: torch.dtype) -> None:
    r = torch.tensor(values, dtype=dtype)
    got = select_rollouts(r, torch.zeros(len(values), dtype=torch.long), 1, m, "max_variance")
    assert got.tolist() == rows


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 1.0, 0.25, -0.5]) | st.floats(-10, 10, width=32), min_size=1, max_size=9),
    st.integers(1, 9),
)
def test_max_variance_property(values: list[float], m: int) -> None:
    n = len(values)
    r = torch.tensor([values], dtype=torch.float64)
    keep = max_variance_subset(r, torch.ones(1, n, dtype=torch.bool), m)[0].tolist()
    if m >= 2:
        kept_variance_ok(values, keep, m)
    else:
        assert sum(keep) == min(n, m)


def test_unequal_interleaved_groups_in_one_batch() -> None:
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        m = rng.randint(2, 6)
        sizes = [0, 1, m - 1, m, m + 1] + [rng.randint(1, 12) for _ in range(6)]
        kind = ["binary", "ties", "continuous"][trial % 3]
        values: list[float] = []
        groups: list[int] = []
        for g, size in enumerate(sizes):
            values += random_rewards(rng, size, kind)
            groups += [g] * size
        perm = list(range(len(values)))
        rng.shuffle(perm)  # interleave groups in row order
        r = torch.tensor([values[i] for i in perm], dtype=torch.float64)
        gi = torch.tensor([groups[i] for i in perm])
        for rule in ("max_variance", "max_reward", "random"):
            kept = select_rollouts(r, gi, len(sizes), m, rule, generator=gen)
            assert torch.equal(kept, torch.sort(kept).values)
            assert kept.unique().numel() == kept.numel()
            for g, size in enumerate(sizes):
                rows_g = (gi == g).nonzero().flatten()
                kept_g = [i for i in kept.tolist() if int(gi[i]) == g]
                assert len(kept_g) == min(size, m)
                vals = r[rows_g].tolist()
                if rule == "max_variance":
                    kept_variance_ok(vals, [int(i) in kept_g for i in rows_g], m)
                if rule == "max_reward" and size > m:
                    top = sorted(vals, reverse=True)[:m]
                    assert sorted(r[kept_g].tolist(), reverse=True) == top


def test_padding_cells_never_selected_even_when_equal_to_fill() -> None:
    r = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])
    gi = torch.tensor([0, 0, 0, 1, 1])
    for rule in ("max_variance", "max_reward", "random"):
        kept = select_rollouts(r, gi, 2, 2, rule, generator=torch.Generator().manual_seed(0))
        assert kept.tolist() == [0, 1, 3, 4]  # both groups have n_i <= m: every real row, nothing else


def test_keep_extremes_when_both_ends_stop_in_one_run() -> None:
    # The rule itself never picks such a k (k-1 gives the same values and wins the tie), but the helper must
    # still keep exactly m rows: k=2 of [1,0,0,0,-1] takes {1,0} + {-1,0}, the two earliest 0s.
    r = torch.tensor([[0.0, 1.0, 0.0, -1.0, 0.0]])
    mask = torch.ones_like(r, dtype=torch.bool)
    top, bottom, _ = _ends(r, mask, 4)
    keep = _keep_extremes(r, mask, top, torch.tensor([2]), bottom)
    assert keep.tolist() == [[True, True, True, True, False]]


# ---------------------------------------------------------------- other rules


def test_max_reward_picks_m_largest_with_earliest_ties() -> None:
    r = torch.tensor([[0.5, 1.0, 0.5, 1.0, 0.2], [3.0, 3.0, 3.0, 0.0, 0.0]])
    mask = torch.ones_like(r, dtype=torch.bool)
    keep = max_reward_subset(r, mask, 3)
    assert keep.tolist() == [[True, True, False, True, False], [True, True, True, False, False]]


def test_random_is_uniform_and_reproducible() -> None:
    n, m, groups = 5, 2, 4000
    r = torch.zeros(groups, n)
    mask = torch.ones(groups, n, dtype=torch.bool)
    keep = random_subset(r, mask, m, torch.Generator().manual_seed(1234))
    assert (keep.sum(1) == m).all()
    freq = Counter(tuple(row) for row in keep.nonzero()[:, 1].view(groups, m).tolist())
    assert len(freq) == math.comb(n, m)
    expected = groups / math.comb(n, m)
    chi2 = sum((c - expected) ** 2 / expected for c in freq.values())
    assert chi2 < 27.9  # 9 degrees of freedom, p = 0.001
    again = random_subset(r, mask, m, torch.Generator().manual_seed(1234))
    other = random_subset(r, mask, m, torch.Generator().manual_seed(99))
    assert torch.equal(keep, again) and not torch.equal(keep, other)


def test_none_rule_and_registry() -> None:
    r = torch.tensor([1.0, 0.0, 1.0])
    assert select_rollouts(r, torch.tensor([1, 0, 1]), 2, 1, "none").tolist() == [0, 1, 2]
    assert set(SELECTION_RULES) == {"max_variance", "max_reward", "random", "none"}


def test_bad_arguments_are_errors() -> None:
    r = torch.tensor([1.0, 0.0])
    gi = torch.tensor([0, 0])
    # the kernel also serves the TRL integration, so it checks its arguments, without the config's key names
    with pytest.raises(ValueError, match="unknown selection rule"):
        select_rollouts(r, gi, 1, 1, "max_entropy")
    with pytest.raises(ValueError, match="m .rows kept per group. must be >= 1"):
        select_rollouts(r, gi, 1, 0, "max_variance")
    for override, key in (("pods.rule=max_entropy", "pods.rule"), ("pods.m=-1", "pods.m")):
        with pytest.raises(ConfigError, match=key):  # the config's own values are refused at load
            load_config(None, ["method=pods", override])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for rule in ("max_variance", "max_reward", "random"):
            with pytest.raises(ValueError, match="NaN"):
                select_rollouts(torch.tensor([1.0, bad, 0.0]), torch.tensor([0, 0, 1]), 3, 1, rule)


# ---------------------------------------------------------------- packing, zero variance, metrics


def test_pack_groups_round_trip() -> None:
    rng = random.Random(5)
    for _ in range(20):
        num_groups = rng.randint(1, 6)
        gi = torch.tensor([rng.randrange(num_groups) for _ in range(rng.randint(0, 30))], dtype=torch.long)
        values = torch.randn(gi.numel())
        padded, mask, rows = pack_groups(values, gi, num_groups, fill=-7.0)
        assert padded.shape == mask.shape == rows.shape
        assert padded.shape[0] == num_groups
        assert torch.equal(mask.sum(1), torch.bincount(gi, minlength=num_groups))
        assert torch.equal(padded[mask], values[rows[mask]])
        assert (padded[~mask] == -7.0).all() and (rows[~mask] == -1).all()
        assert sorted(rows[mask].tolist()) == list(range(gi.numel()))
        for g in range(num_groups):  # generation order kept, padding at the end
            assert rows[g][mask[g]].tolist() == (gi == g).nonzero().flatten().tolist()
            assert mask[g].tolist() == sorted(mask[g].tolist(), reverse=True)
    # Prompt-major equal groups (the layout the generator produces) give the plain [P, n] table.
    values = torch.arange(12.0)
    padded, mask, rows = pack_groups(values, torch.arange(3).repeat_interleave(4), 3, fill=0.0)
    assert (
        torch.equal(padded, values.view(3, 4))
        and mask.all()
        and torch.equal(rows, torch.arange(12).view(3, 4))
    )
    with pytest.raises(ValueError, match="group_index"):
        pack_groups(torch.zeros(2), torch.tensor([0, 3]), 2, 0.0)


def test_zero_variance_groups() -> None:
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5 + 1e-8, 2.0])
    gi = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert zero_variance_groups(r, gi, 5).tolist() == [True, False, True, True, True]


def test_selection_metrics_hand_computed() -> None:
    # group 0: [1,0,0,0] -> keep [1,0]; group 1: [1,1,1] -> keep [1,1]; group 2: one row
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.3])
    gi = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    kept = select_rollouts(r, gi, 4, 2, "max_variance")
    assert kept.tolist() == [0, 1, 4, 5, 7]
    out = selection_metrics(r, gi, 4, kept)
    assert out["select/reward_std_before"] == pytest.approx(0.5 / 3)  # std([1,0,0,0]) = 0.5
    assert out["select/reward_std_after"] == pytest.approx(math.sqrt(0.5) / 3)
    assert out["select/frac_zero_std_before"] == pytest.approx(2 / 3)
    assert out["select/frac_zero_std_after"] == pytest.approx(2 / 3)
