"""GRESO: skip prompts predicted to give a zero-variance group, before rolling them out (docs/methods.md#greso).

A prompt whose last z_e visits were all-correct is skipped as "easy" with probability 1 − max(p_easy^z_e, floor);
otherwise one whose last z_h visits were all-wrong is skipped as "hard" with probability 1 − max(p_hard^z_h, floor).
A prompt with no history or a streak of 0 is never skipped. p_easy and p_hard adapt after every step (from the
first completed epoch on) so that the share of all-correct / all-wrong groups tracks its target.

Pure functions over [P] tensors and floats; the state (streaks, p_easy, p_hard) lives with the caller.
"""

from __future__ import annotations

import torch

SKIPPED_EASY, SKIPPED_HARD, KEPT = 0, 1, 2  # codes of the per-prompt skip log, as in the reference


def skip_probabilities(easy_streak: torch.Tensor, hard_streak: torch.Tensor, p_easy: float, p_hard: float,
                       floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([P] probability of skipping as easy, [P] probability of skipping as hard); 0 where the streak is 0."""
    def prob(streak: torch.Tensor, p: float) -> torch.Tensor:
        z = streak.double()
        return torch.where(z > 0, 1.0 - (p ** z).clamp(min=floor), torch.zeros_like(z))

    return prob(easy_streak, p_easy), prob(hard_streak, p_hard)


def skip_decisions(easy_streak: torch.Tensor, hard_streak: torch.Tensor, p_easy: float, p_hard: float,
                   uniforms: torch.Tensor, floor: float) -> torch.Tensor:
    """[P] long codes: SKIPPED_EASY, SKIPPED_HARD or KEPT. `uniforms` [P, 2] holds one draw per test (easy
    first, then hard); a test skips when its draw is below its probability."""
    easy_p, hard_p = skip_probabilities(easy_streak, hard_streak, p_easy, p_hard, floor)
    skip_easy = uniforms[:, 0].double() < easy_p
    skip_hard = ~skip_easy & (uniforms[:, 1].double() < hard_p)
    codes = torch.full(easy_streak.shape, KEPT, dtype=torch.long)
    codes[skip_hard] = SKIPPED_HARD
    codes[skip_easy] = SKIPPED_EASY
    return codes


def adapt_exploration(p: float, ratio: float, target: float, step: float, lowest: float, highest: float) -> float:
    """One adaptation step: skip more (p − step) when the zero-variance share reached its target, else less."""
    p = p - step if ratio >= target else p + step
    return round(min(max(p, lowest), highest), 12)  # rounding keeps 0.5 - 0.01 from drifting to 0.48999...


def refill_estimate(missing: int, zero_variance_fraction: float, scale: float, lowest: int, highest: int) -> int:
    """Prompts to draw so that, at this round's zero-variance fraction, about `missing` informative groups come
    back: int(missing / (1 − zvr) · scale), clamped to [lowest, highest]. With zvr = 1 (the reference divides by
    zero) the estimate is `highest`."""
    if missing <= 0:
        return 0
    if zero_variance_fraction >= 1.0:
        estimate = highest
    else:
        estimate = min(int(missing / (1.0 - zero_variance_fraction) * scale), highest)
    return max(estimate, lowest)
