"""AERO (docs/methods.md#aero): adaptive rollouts in rounds, selective rejection, Bayesian posterior for dead zones.

One step: `collect` explores every prompt with aero.n_explore rollouts and rescues all-fail prompts aero.n_extra at a
time up to aero.n_max (each round one batched generate call); the loop then records the outcomes in the run-long
PromptStats; `select` reads each prompt's Beta posterior mean ũ, applies selective rejection and dead-zone trimming
(algo/selection.py) and gives the kept rows their advantages (algo/advantages.py).

Posterior order (decision): the posterior for step t includes step t's own rollouts (all that were generated,
rescue rounds included, before selection). METHODS counts S and F "over the whole run", and the current group is
the freshest evidence about the prompt: without it a prompt seen for the first time would get ũ = 0.5, i.e.
advantage -1 for every all-fail rollout in baseline mode and exactly 0 in constant mode, whatever the 16 failures
just observed say.

Rescued groups (decision, `aero.reject_rescued`): a group that needed rescue and got a success is judged by its u
after the rescue, so selective rejection trims its failures like any minority-success group (default true);
false keeps every rollout of a rescued group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from podsrl.algo.advantages import aero_advantages, grpo_advantages
from podsrl.algo.group_stats import group_outcomes
from podsrl.algo.selection import aero_select, selection_metrics
from podsrl.batch import RolloutBatch, concat_batches
from podsrl.errors import ConfigError
from podsrl.methods.base import ConfigView, Method, StepContext
from podsrl.options import option

GenerateAndScore = Callable[[list[int], list[int]], RolloutBatch]

_ZERO_TOL = 1e-6  # |advantage| at or below this counts as "zero" in the metrics


@dataclass
class AeroConfig:
    n_explore: int = option(8, "Rollouts per prompt in the exploration round.")
    n_extra: int = option(2, "Rollouts added per rescue round to prompts with no success yet.")
    n_max: int = option(16, "Per-prompt cap on rollouts (rescue stops there).")
    k: float = option(1.0, "Selective rejection keeps all c successes and k*c failures when 0 < u < 0.5.")
    symmetric: bool = option(False, "Also trim u > 0.5 groups to all failures plus k times as many successes.")
    keep_dead: int = option(4, "Rollouts kept from an all-fail/all-success group (they get the posterior advantage).")
    dead_zone_advantage: Literal["baseline", "constant"] = option(
        "baseline", "(r - u~)/sqrt(u~(1-u~)) with u~ the posterior mean, or the constant 2u~ - 1."
    )
    alpha0: float = option(1.0, "Beta prior alpha of each prompt's success rate.")
    beta0: float = option(1.0, "Beta prior beta of each prompt's success rate.")
    reject_rescued: bool = option(True, "Also apply selective rejection to groups that the rescue rounds turned from "
                                  "all-fail into minority-success (their u is recomputed after rescue).")


class AERO(Method):
    name = "aero"
    section = AeroConfig
    uses_rollout_n = False  # n_explore / n_max size the groups

    @classmethod
    def validate(cls, cfg: ConfigView) -> None:
        a = cfg.aero

        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {msg}")

        need(1 <= a.n_explore <= a.n_max, "aero.n_explore", "must be in [1, aero.n_max]")
        need(a.n_extra >= 1, "aero.n_extra", "must be >= 1")
        need(a.k > 0, "aero.k", "must be > 0")
        need(a.keep_dead >= 1, "aero.keep_dead", "must be >= 1")
        need(a.alpha0 > 0 and a.beta0 > 0, "aero.alpha0", "Beta prior parameters must be > 0")
        need(not cfg.filter.zero_variance, "filter.zero_variance", "AERO gives all-same groups a posterior "
             "advantage; filtering them would drop the very groups it rescues. Turn one off")

    def collect(self, problems, ctx: StepContext) -> tuple[RolloutBatch, dict[str, float]]:
        a = self.cfg.aero
        return collect_aero_rollouts(len(problems), lambda idx, counts: ctx.generate(problems, idx, counts),
                                     n_explore=a.n_explore, n_extra=a.n_extra, n_max=a.n_max,
                                     pad_token_id=ctx.pad_token_id)

    def select(self, batch: RolloutBatch, ctx: StepContext) -> tuple[RolloutBatch, dict[str, float]]:
        a, algo = self.cfg.aero, self.cfg.algo
        posterior = ctx.stats.posterior_mean([p.uid for p in batch.problems], a.alpha0, a.beta0)
        exempt = None if a.reject_rescued else rescued_groups(batch, a.n_explore)
        rows, dead, metrics = aero_select(batch, posterior, k=a.k, symmetric=a.symmetric, keep_dead=a.keep_dead,
                                          generator=ctx.rng, exempt=exempt)
        kept = batch.select_rows(rows)
        kept.advantages = aero_advantages(kept.rewards, kept.correct, kept.group_index, kept.num_groups, dead,
                                          posterior, mode=a.dead_zone_advantage, epsilon=algo.advantage_epsilon,
                                          scale=algo.scale)
        before = grpo_advantages(kept.rewards, kept.group_index, kept.num_groups, algo.scale, algo.advantage_epsilon)
        metrics["aero/frac_zero_adv_before"] = _frac_zero(before)
        metrics["aero/frac_zero_adv_after"] = _frac_zero(kept.advantages)
        metrics.update(selection_metrics(batch.rewards, batch.group_index, batch.num_groups, rows))
        return kept, metrics


def rescued_groups(batch: RolloutBatch, n_explore: int) -> torch.Tensor:
    """[P] bool: groups that needed rescue (rescue rounds only run for prompts with no success, so they hold more
    than n_explore rows) and have a success now."""
    n, c = group_outcomes(batch.group_index, batch.correct, batch.num_groups)
    return (n > n_explore) & (c > 0)


def _frac_zero(adv: torch.Tensor) -> float:
    return (adv.abs() <= _ZERO_TOL).float().mean().item() if adv.numel() else 0.0


# --------------------------------------------------------------------------------------------- rounds


def collect_aero_rollouts(
    num_prompts: int,
    generate_and_score: GenerateAndScore,
    *,
    n_explore: int,
    n_extra: int,
    n_max: int,
    pad_token_id: int,
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
    got_n, got_c = group_outcomes(g, batch.correct.cpu(), num_prompts)
    want = torch.zeros(num_prompts, dtype=torch.long)
    want[torch.tensor(indices, dtype=torch.long)] = torch.tensor(counts, dtype=torch.long)
    if not torch.equal(got_n, want):
        bad = int((got_n != want).nonzero()[0])
        raise ValueError(
            f"generate_and_score returned {int(got_n[bad])} rollouts for problem {bad}, asked for {int(want[bad])}"
        )
    return got_n, got_c
