"""AERO: adaptive rollouts in rounds, selective rejection, Bayesian posterior for dead zones (METHODS.md §3).

Pure pieces the trainer plugs in, in this order for one step:

    batch, m1 = collect_aero_rollouts(P, generate_and_score, n_explore, n_extra, n_max, pad_token_id)
    u_tilde  = posterior_after_update(stats, batch)           # this step's outcomes are counted first
    kept, dead, m2 = aero_select(batch, u_tilde, k, symmetric, keep_dead, generator)
    train = batch.select_rows(kept)
    train.advantages = aero_advantages(train.rewards, train.correct, train.group_index, P, dead, u_tilde)

Everything is vectorised over groups (bincount / scatter / one sort); there is no Python loop per prompt.

Posterior order (decision): the posterior for step t includes step t's own rollouts (all that were generated,
rescue rounds included, before selection). METHODS counts S and F "over the whole run", and the current group is
the freshest evidence about the prompt: without it a prompt seen for the first time would get ũ = 0.5, i.e.
advantage -1 for every all-fail rollout in baseline mode and exactly 0 in constant mode, whatever the 16 failures
just observed say.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from podsrl.batch import RolloutBatch, concat_batches
from podsrl.select.prompt_stats import PromptStats

GenerateAndScore = Callable[[list[int], list[int]], RolloutBatch]

DEAD_ZONE_MODES = ("baseline", "constant")
_ZERO_TOL = 1e-6  # |advantage| at or below this counts as "zero" in the metrics


# --------------------------------------------------------------------------------------------- rounds


def collect_aero_rollouts(
    num_prompts: int,
    generate_and_score: GenerateAndScore,
    n_explore: int = 8,
    n_extra: int = 2,
    n_max: int = 16,
    pad_token_id: int = 0,
) -> tuple[RolloutBatch, dict[str, float]]:
    """Explore every prompt with `n_explore` rollouts, then rescue all-fail prompts in batched rounds.

    `generate_and_score(prompt_indices, counts)` samples counts[j] rollouts of problem prompt_indices[j] and returns
    them scored (with `correct`) as a RolloutBatch over the step's full problems list, group_index = original
    problem index. Each rescue round is ONE call covering every prompt that still has no success and fewer than
    `n_max` rollouts, asking `min(n_extra, n_max - rollouts so far)` more for each. Rounds stop when no prompt
    qualifies. The returned batch is the concatenation of all rounds (rows of one prompt need not be contiguous).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if n_explore < 1 or n_extra < 1:
        raise ValueError(f"n_explore and n_extra must be >= 1, got {n_explore} and {n_extra}")
    if n_max < n_explore:
        raise ValueError(f"n_max ({n_max}) must be >= n_explore ({n_explore})")

    successes = torch.zeros(num_prompts, dtype=torch.long)
    attempts = torch.zeros(num_prompts, dtype=torch.long)
    batches: list[RolloutBatch] = []

    def run_round(indices: list[int], counts: list[int]) -> None:
        batch = generate_and_score(indices, counts)
        got_n, got_c = _check_round(batch, num_prompts, indices, counts)
        attempts.add_(got_n)
        successes.add_(got_c)
        batches.append(batch)

    run_round(list(range(num_prompts)), [n_explore] * num_prompts)
    needed_rescue = successes == 0
    while True:
        todo = (successes == 0) & (attempts < n_max)
        if not bool(todo.any()):
            break
        idx = todo.nonzero(as_tuple=True)[0]
        counts = (n_max - attempts[idx]).clamp(max=n_extra)
        run_round(idx.tolist(), counts.tolist())

    batch = batches[0] if len(batches) == 1 else concat_batches(batches, pad_token_id)
    rescued = needed_rescue & (successes > 0)
    rescue_failed = needed_rescue & (successes == 0)
    explore_rows = batches[0].num_rollouts
    metrics = {
        "aero/rounds": float(len(batches)),
        "aero/rollouts_generated": float(batch.num_rollouts),
        "aero/rollouts_rescue": float(batch.num_rollouts - explore_rows),
        "aero/frac_needed_rescue": needed_rescue.float().mean().item(),
        "aero/frac_rescued": rescued.float().mean().item(),
        "aero/frac_rescue_failed": rescue_failed.float().mean().item(),
        "aero/mean_rollouts_per_prompt": attempts.float().mean().item(),
    }
    return batch, metrics


def _check_round(
    batch: RolloutBatch, num_prompts: int, indices: list[int], counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt (attempts, successes) of one round, after checking the round returned exactly what was asked."""
    if batch.correct is None:
        raise ValueError("generate_and_score must return a scored batch (batch.correct is None)")
    if batch.num_groups != num_prompts:
        raise ValueError(f"generate_and_score returned {batch.num_groups} problems, expected the step's {num_prompts}")
    g = batch.group_index.cpu()
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= num_prompts):
        raise ValueError("generate_and_score returned group_index values outside the step's problems")
    got_n = torch.bincount(g, minlength=num_prompts)
    want = torch.zeros(num_prompts, dtype=torch.long)
    want[torch.tensor(indices, dtype=torch.long)] = torch.tensor(counts, dtype=torch.long)
    if not torch.equal(got_n, want):
        bad = int((got_n != want).nonzero()[0])
        raise ValueError(
            f"generate_and_score returned {int(got_n[bad])} rollouts for problem {bad}, asked for {int(want[bad])}"
        )
    got_c = torch.bincount(g[batch.correct.cpu().bool()], minlength=num_prompts)
    return got_n, got_c


# --------------------------------------------------------------------------------------------- posterior


def posterior_after_update(
    stats: PromptStats, batch: RolloutBatch, alpha0: float = 1.0, beta0: float = 1.0
) -> torch.Tensor:
    """Add this step's generated rollouts to the run-long statistics, then return [P] posterior means ũ.

    Call once per step with the batch of ALL generated rollouts (before selection): rejected rollouts are still
    evidence about the prompt's success rate.
    """
    if batch.correct is None:
        raise ValueError("posterior_after_update needs a scored batch (batch.correct is None)")
    uids = [p.uid for p in batch.problems]
    stats.update_from_groups(uids, batch.group_index, batch.correct)
    return stats.posterior_mean(uids, alpha0, beta0)


# --------------------------------------------------------------------------------------------- selection


def aero_select(
    batch: RolloutBatch,
    posterior_mean: torch.Tensor,
    k: float = 1.0,
    symmetric: bool = False,
    keep_dead: int = 4,
    generator: torch.Generator | None = None,
    mode: str = "baseline",
    epsilon: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Selective rejection and dead-zone trimming. Returns (kept rows sorted ascending, dead [P] bool, metrics).

    Per group with c successes of n (u = c/n):
    - 0 < u < 0.5: all c successes + min(round(k·c), failures) random failures (at least 1, so a success/failure
      contrast survives even for k < 0.5); round is half-up.
    - symmetric and 0.5 < u < 1: all failures + min(round(k·f), successes) random successes (at least 1).
    - u = 0 or u = 1 (dead zone): `keep_dead` random rollouts (all if fewer).
    - anything else (u = 0.5, or u > 0.5 without `symmetric`): everything.
    `mode` and `epsilon` only feed the zero-advantage metrics (they must match what aero_advantages will use).
    """
    if batch.correct is None:
        raise ValueError("aero_select needs a scored batch (batch.correct is None)")
    if k <= 0:
        raise ValueError(f"k must be > 0, got {k}")
    if keep_dead < 0:
        raise ValueError(f"keep_dead must be >= 0, got {keep_dead}")
    num_groups = batch.num_groups
    if posterior_mean.shape != (num_groups,):
        raise ValueError(f"posterior_mean has shape {tuple(posterior_mean.shape)}, expected ({num_groups},)")
    g = batch.group_index
    correct = batch.correct.bool()
    device = g.device

    n = torch.bincount(g, minlength=num_groups)
    c = torch.bincount(g[correct], minlength=num_groups)
    f = n - c
    dead = (n > 0) & ((c == 0) | (c == n))
    minority = (c > 0) & (2 * c < n)
    majority = (f > 0) & (2 * f < n) if symmetric else torch.zeros_like(dead)

    # Quota per (group, outcome) bucket 2g + correct; rows are ranked inside their bucket by a random key.
    quota_fail = torch.where(minority, _scaled_count(k, c).clamp(min=1).minimum(f), f)
    quota_succ = torch.where(majority, _scaled_count(k, f).clamp(min=1).minimum(c), c)
    quota_fail = torch.where(dead, f.clamp(max=keep_dead), quota_fail)
    quota_succ = torch.where(dead, c.clamp(max=keep_dead), quota_succ)
    quota = torch.stack([quota_fail, quota_succ], dim=1).reshape(-1)

    bucket = 2 * g + correct.long()
    key_device = generator.device if generator is not None else torch.device("cpu")
    keys = torch.rand(g.numel(), generator=generator, device=key_device).to(device)
    order = torch.argsort(keys)
    order = order[torch.argsort(bucket[order], stable=True)]
    sorted_bucket = bucket[order]
    bucket_sizes = torch.bincount(bucket, minlength=2 * num_groups)
    bucket_start = torch.cumsum(bucket_sizes, 0) - bucket_sizes
    rank = torch.arange(g.numel(), device=device) - bucket_start[sorted_bucket]
    kept = torch.sort(order[rank < quota[sorted_bucket]]).values

    nonempty = (n > 0).sum().clamp(min=1).float()
    kept_per_group = quota_fail + quota_succ
    rejected = (minority | majority) & (kept_per_group < n)
    metrics = {
        "aero/frac_rejected_groups": (rejected.sum() / nonempty).item(),
        "aero/frac_dead_zone": (dead.sum() / nonempty).item(),
        "aero/frac_rollouts_kept": kept.numel() / max(g.numel(), 1),
    }
    rewards = batch.rewards if batch.rewards is not None else correct.float()
    kr, kc, kg = rewards[kept], correct[kept], g[kept]
    before = group_advantages(kr, kg, num_groups, epsilon)
    after = aero_advantages(kr, kc, kg, num_groups, dead, posterior_mean, mode=mode, epsilon=epsilon)
    metrics["aero/frac_zero_adv_before"] = _frac_zero(before)
    metrics["aero/frac_zero_adv_after"] = _frac_zero(after)
    return kept, dead, metrics


def _scaled_count(k: float, count: torch.Tensor) -> torch.Tensor:
    """round(k·count), halves rounded up (torch.round would send 2.5 to 2)."""
    return torch.floor(k * count.double() + 0.5).long()


def _frac_zero(adv: torch.Tensor) -> float:
    return (adv.abs() <= _ZERO_TOL).float().mean().item() if adv.numel() else 0.0


# --------------------------------------------------------------------------------------------- advantages


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int, epsilon: float = 1e-4
) -> torch.Tensor:
    """GRPO advantage (r − mean_g) / (std_g + ε) with unbiased std over the rows present; size-1 or
    constant-reward groups get exactly 0 (not a rounding residue)."""
    r = rewards.double()
    g = group_index
    n = torch.bincount(g, minlength=num_groups).double()
    mean = torch.bincount(g, weights=r, minlength=num_groups) / n.clamp(min=1)
    dev = r - mean[g]
    var = torch.bincount(g, weights=dev * dev, minlength=num_groups) / (n - 1).clamp(min=1)
    lo = torch.full((num_groups,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, g, r, "amin")
    hi = torch.full((num_groups,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, g, r, "amax")
    flat = (n < 2) | (lo == hi)
    adv = dev / (var.sqrt()[g] + epsilon)
    return torch.where(flat[g], torch.zeros_like(adv), adv).to(rewards.dtype)


def aero_advantages(
    rewards: torch.Tensor,
    correct: torch.Tensor,
    group_index: torch.Tensor,
    num_groups: int,
    dead: torch.Tensor,
    posterior_mean: torch.Tensor,
    mode: str = "baseline",
    epsilon: float = 1e-4,
) -> torch.Tensor:
    """[R] advantages of the kept rows: posterior treatment for dead groups, GRPO over the kept rows otherwise.

    Dead groups, with ũ = posterior_mean[group]:
    - "baseline": (x − ũ) / sqrt(ũ(1−ũ)), denominator clamped to >= epsilon. x is the correctness bit, not the
      training reward: ũ is a success rate, so this is the standardised Bernoulli score, and a format bonus on top
      of the reward could otherwise turn failures in an all-fail group into positive advantages.
    - "constant": 2ũ − 1 for every kept rollout of the group.
    """
    if mode not in DEAD_ZONE_MODES:
        raise ValueError(f"dead-zone advantage mode must be one of {DEAD_ZONE_MODES}, got {mode!r}")
    if dead.shape != (num_groups,) or posterior_mean.shape != (num_groups,):
        raise ValueError(
            f"dead {tuple(dead.shape)} and posterior_mean {tuple(posterior_mean.shape)} must both be ({num_groups},)"
        )
    adv = group_advantages(rewards, group_index, num_groups, epsilon).double()
    u = posterior_mean.to(device=rewards.device, dtype=torch.float64)[group_index]
    if mode == "baseline":
        dz = (correct.double() - u) / (u * (1.0 - u)).clamp(min=0.0).sqrt().clamp(min=epsilon)
    else:
        dz = 2.0 * u - 1.0
    row_dead = dead.to(rewards.device)[group_index]
    return torch.where(row_dead, dz, adv).to(rewards.dtype)
