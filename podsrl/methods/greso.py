"""GRESO (docs/methods.md#greso): skip prompts predicted to give a zero-variance group before rolling them out, on
top of zero-variance filtering with bounded refill (DAPO dynamic sampling, the generic `filter.*`).

collect: each prompt whose newest visits were all correct (all wrong) is skipped with a probability that grows
with the streak; a skipped prompt is replaced by the sampler's next one (bounded by `greso.max_scan`), and the
prompts that pass get rollout.n rollouts each. refill_count: the DAPO/GRESO estimate of how many prompts the refill
must draw. end_step: from the second epoch on, p_easy and p_hard move so that the shares of all-correct and
all-wrong groups track their targets. Streaks live in PromptStats (updated by the loop on every visit); p_easy and
p_hard are this method's checkpointed state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from podsrl.algo.greso import (
    KEPT,
    SKIPPED_EASY,
    SKIPPED_HARD,
    adapt_exploration,
    refill_estimate,
    skip_decisions,
)
from podsrl.algo.group_stats import group_outcomes
from podsrl.batch import Problem, RolloutBatch
from podsrl.errors import ConfigError
from podsrl.methods.base import ConfigView, Method, StepContext
from podsrl.options import option


@dataclass
class GresoConfig:
    p_init: float = option(0.5, "Starting p_easy and p_hard: a prompt all-correct on its last z visits is skipped with "
                           "probability 1 - max(p_easy^z, min_keep); likewise all-wrong with p_hard.")
    min_keep: float = option(0.01, "Smallest probability of keeping a prompt however long its streak.")
    skip: Literal["both", "easy", "hard"] = option(
        "both", "Which predictions may skip a prompt: both (the method), easy (all-correct streaks only: prompts the "
        "model fails are always rolled out) or hard (all-wrong streaks only). For ablations.")
    target_zero_variance: float = option(0.25, "Target share T of zero-variance groups: p_easy adapts towards T/3 "
                                         "all-correct groups per step, p_hard towards 2T/3 all-wrong ones.")
    p_step: float = option(0.01, "Change of p_easy / p_hard after each step (from the second epoch on).")
    p_min: float = option(0.05, "Lower clamp of p_easy and p_hard.")
    p_max: float = option(0.95, "Upper clamp of p_easy and p_hard.")
    max_scan: float = option(4.0, "Most replacement prompts drawn for skipped ones per collect, as a multiple of the "
                             "prompts asked for; when spent, the prompts that passed are rolled out.")
    refill_scale: float = option(1.25, "Refill draws int(missing / (1 - zero-variance fraction) * refill_scale) prompts "
                                 "(DAPO/GRESO estimate) ...")
    refill_min: float = option(0.25, "... at least this fraction of rollout.prompts_per_step ...")
    refill_max: float = option(1.5, "... and at most this fraction of rollout.prompts_per_step.")


class Greso(Method):
    name = "greso"
    section = GresoConfig

    def __init__(self, cfg: ConfigView) -> None:
        super().__init__(cfg)
        self.p_easy = self.p_hard = cfg.greso.p_init
        self._skipped = [0, 0, 0]  # this step's prompts skipped easy, skipped hard, kept (codes 0, 1, 2)

    @classmethod
    def validate(cls, cfg: ConfigView) -> None:
        g = cfg.greso
        if not 0 < g.p_min <= g.p_init <= g.p_max < 1:
            raise ConfigError("greso.p_init: need 0 < greso.p_min <= greso.p_init <= greso.p_max < 1 "
                              f"(got {g.p_min}, {g.p_init}, {g.p_max})")
        for key in ("min_keep", "target_zero_variance"):
            if not 0 < getattr(g, key) <= 1:
                raise ConfigError(f"greso.{key}: must be in (0, 1], got {getattr(g, key)}")
        for key in ("p_step", "max_scan", "refill_scale", "refill_min", "refill_max"):
            if getattr(g, key) < 0:
                raise ConfigError(f"greso.{key}: must be >= 0, got {getattr(g, key)}")
        if g.refill_min > g.refill_max:
            raise ConfigError(f"greso.refill_min ({g.refill_min}) must be <= greso.refill_max ({g.refill_max})")

    def _skip_codes(self, problems: list[Problem], ctx: StepContext) -> list[int]:
        """Per problem SKIPPED_EASY, SKIPPED_HARD or KEPT (one pair of uniform draws each, easy test first),
        counted into this step's totals."""
        easy, hard = ctx.stats.streaks([p.uid for p in problems])
        if self.cfg.greso.skip == "easy":  # a streak of 0 is never skipped
            hard = torch.zeros_like(hard)
        elif self.cfg.greso.skip == "hard":
            easy = torch.zeros_like(easy)
        draws = torch.rand((len(problems), 2), generator=ctx.rng)
        codes = skip_decisions(easy, hard, self.p_easy, self.p_hard, draws, floor=self.cfg.greso.min_keep).tolist()
        for code in codes:
            self._skipped[code] += 1
        return codes

    def collect(self, problems: list[Problem], ctx: StepContext) -> tuple[RolloutBatch, dict]:
        wanted = len(problems)
        first = self._skip_codes(problems, ctx)
        kept = [p for p, c in zip(problems, first) if c == KEPT]
        budget = math.floor(self.cfg.greso.max_scan * wanted)  # replacement draws this collect may make
        while len(kept) < wanted and budget > 0:  # skipped prompts are replaced by the sampler's next ones
            more = ctx.draw(min(wanted - len(kept), budget))
            budget -= len(more)
            kept += [p for p, c in zip(more, self._skip_codes(more, ctx)) if c == KEPT]
        if not kept:  # every prompt skipped and the scan spent: roll out the first asked-for one, counted as kept
            kept = problems[:1]
            self._skipped[first[0]] -= 1
            self._skipped[KEPT] += 1
        n = self.cfg.rollout.n
        batch = ctx.generate(kept, list(range(len(kept))), [n] * len(kept))
        return batch, {"examples/scan_exhausted": float(len(kept) < wanted)}

    def refill_count(self, missing: int, zero_variance_fraction: float) -> int:
        g, prompts = self.cfg.greso, self.cfg.rollout.prompts_per_step
        # at least one prompt: refill_min 0 with refill_scale < 1 would otherwise round a small estimate down to 0
        return refill_estimate(missing, zero_variance_fraction, g.refill_scale,
                               lowest=max(1, math.ceil(g.refill_min * prompts)),
                               highest=max(1, math.ceil(g.refill_max * prompts)))

    def end_step(self, generated: list[RolloutBatch], ctx: StepContext) -> dict:
        """Shares of all-correct / all-wrong groups among every group rolled out this step, then adapt p."""
        groups = easy = hard = 0
        for b in generated:
            attempts, successes = group_outcomes(b.group_index, b.correct, b.num_groups)
            present = attempts > 0
            groups += int(present.sum())
            easy += int((present & (successes == attempts)).sum())
            hard += int((present & (successes == 0)).sum())
        easy_ratio, hard_ratio = easy / max(groups, 1), hard / max(groups, 1)
        g = self.cfg.greso
        if ctx.epoch > 0:
            kw = dict(step=g.p_step, lowest=g.p_min, highest=g.p_max)
            self.p_easy = adapt_exploration(self.p_easy, easy_ratio, g.target_zero_variance / 3, **kw)
            self.p_hard = adapt_exploration(self.p_hard, hard_ratio, 2 * g.target_zero_variance / 3, **kw)
        metrics = {
            "examples/p_easy": self.p_easy, "examples/p_hard": self.p_hard,
            "examples/too_easy_ratio": easy_ratio, "examples/too_hard_ratio": hard_ratio,
            "examples/total_sampled": float(groups),
            "examples/skipped_easy": float(self._skipped[SKIPPED_EASY]),
            "examples/skipped_hard": float(self._skipped[SKIPPED_HARD]),
            "examples/kept": float(self._skipped[KEPT]),
        }
        self._skipped = [0, 0, 0]
        return metrics

    def state_dict(self) -> dict:
        return {"p_easy": self.p_easy, "p_hard": self.p_hard}

    def load_state_dict(self, state: dict) -> None:
        p_init = self.cfg.greso.p_init  # a checkpoint from before the method was chosen has no state
        self.p_easy, self.p_hard = float(state.get("p_easy", p_init)), float(state.get("p_hard", p_init))
