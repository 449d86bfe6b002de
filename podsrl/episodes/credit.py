"""Turn-level credit (`episode.credit: turn`): an episode's per-turn rewards spread into token-level advantages.

The method computes its advantage A_r of each kept episode from the episode's reward R_r as always (the turn rewards
are part of R_r through the task's reward: an `environment` task without `reward()` sums them), and selects as
always. Credit then shifts each turn's tokens by what that turn could not have caused. With r_k the reward of turn k
(0 where the step gave none), T the episode's turns, the remainder R_r - sum_k r_k (the reward functions' part not
given per turn) counted at the last turn, and g = episode.turn_discount:

    G_t = sum_{k >= t} g^(k - t) r_k + g^(T - 1 - t) (R_r - sum_k r_k)        (the return from turn t on)
    A_{r, token of turn t} = A_r + (G_t - R_r) / (std_g + eps)

std_g is the group's reward std over the kept rows as algo.scale takes it (group, batch, or 1 for none; a constant
group gets no shift, as GRPO gives it no advantage). With g = 1 the first turn's tokens get A_r itself and a later
turn's lose the rewards earned before it. `episode.credit: episode` leaves every token at A_r.
"""

from __future__ import annotations

import torch

from podsrl.algo.advantages import grpo_advantages


def turn_returns(rewards: torch.Tensor, turn_rewards: torch.Tensor, turns: torch.Tensor,
                 discount: float) -> torch.Tensor:
    """[R, T] float64 G_t of each row's turns t < turns[r] (0 beyond). rewards: [R] episode rewards; turn_rewards:
    [R, T] (0 where none and beyond the row's turns); turns: [R] long, turns each row took."""
    r = turn_rewards.double()
    num_turns = r.shape[1]
    last = (turns - 1).clamp(min=0)
    remainder = rewards.double() - r.sum(dim=1)
    returns = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=torch.float64)
    for t in range(num_turns - 1, -1, -1):  # backwards: G_t = r_t + g G_{t+1}, the remainder entering at the last
        inside = t < turns
        running = torch.where(inside, r[:, t] + discount * running + torch.where(t == last, remainder, 0.0), 0.0)
        returns[:, t] = running
    return returns


def turn_credit(advantages: torch.Tensor, rewards: torch.Tensor, group_index: torch.Tensor, num_groups: int,
                turn_index: torch.Tensor, turn_rewards: torch.Tensor, discount: float, scale: str,
                epsilon: float) -> torch.Tensor:
    """[R, Lc] float32 token advantages. advantages, rewards, group_index: [R] (the method's A_r, the episode
    rewards, groups); turn_index: [R, Lc] long, the turn each completion token belongs to (an environment message
    to the turn before it); turn_rewards: [R, T]."""
    turns = turn_index.max(dim=1).values.clamp(min=0) + 1 if turn_index.numel() else torch.ones_like(group_index)
    returns = turn_returns(rewards, turn_rewards, turns, discount)
    token_returns = returns.gather(1, turn_index.clamp(min=0, max=max(returns.shape[1] - 1, 0)))
    width = token_returns.shape[1]
    rows = group_index[:, None].expand(-1, width).reshape(-1)
    stats = (rewards, group_index)  # the shift is in the units of the method's advantage: (G_t - R) / std
    shifted = grpo_advantages(token_returns.reshape(-1).float(), rows, num_groups, scale, epsilon, *stats)
    base = grpo_advantages(rewards.float(), group_index, num_groups, scale, epsilon, *stats)
    return advantages.float()[:, None] + (shifted.view(-1, width) - base[:, None])
