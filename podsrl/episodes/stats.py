"""What a step's episodes did, counted over every generate call of the step, and its metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from podsrl.batch import RolloutBatch

# why an episode ended; "stopped": the method's rule stopped it between turns, its group being decided (never scored);
# "timeout": its environment's reset or step ran past its time limit; "context": it reached the model's context
ENDINGS = ("answer", "turns", "tokens", "context", "environment_fault", "timeout", "stopped")


@dataclass
class EpisodeStats:
    episodes: int = 0
    turns: int = 0
    endings: Counter = field(default_factory=Counter)  # ENDINGS -> episodes
    tool_calls: Counter = field(default_factory=Counter)  # tool name -> calls
    tool_faults: Counter = field(default_factory=Counter)  # tool name -> faulty calls
    truncated_responses: int = 0  # tool answers and environment messages cut to episode.max_response_chars

    def add(self, other: EpisodeStats) -> None:
        self.episodes += other.episodes
        self.turns += other.turns
        self.endings.update(other.endings)
        self.tool_calls.update(other.tool_calls)
        self.tool_faults.update(other.tool_faults)
        self.truncated_responses += other.truncated_responses

    def metrics(self) -> dict[str, float]:
        """Per-episode means and shares, and the step's counts of tool calls and faults (in total and per tool)."""
        n = max(self.episodes, 1)
        out = {"episode/turns": self.turns / n,
               "episode/tool_calls": float(sum(self.tool_calls.values())),
               "episode/tool_faults": float(sum(self.tool_faults.values())),
               "episode/stopped": float(self.endings["stopped"]),
               "episode/truncated_responses": float(self.truncated_responses)}
        out.update({f"episode/ended_by_{e}": self.endings[e] / n for e in ENDINGS})
        for name in sorted(self.tool_calls):
            out[f"episode/tool_calls/{name}"] = float(self.tool_calls[name])
            out[f"episode/tool_faults/{name}"] = float(self.tool_faults[name])
        return out


def trained_metrics(kept: RolloutBatch) -> dict[str, float]:
    """What the trained episodes look like (an early-stopping rule keeps the episodes that finish first): model
    turns per episode (runs of model tokens: every turn but the last is a tool call, unless the turns ran out) and
    completion tokens per episode (model and environment tokens)."""
    mask = kept.trained_mask
    starts = torch.cat([mask[:, :1], (mask[:, 1:] > mask[:, :-1]).float()], dim=1)
    n = max(kept.num_rollouts, 1)
    return {"episode/trained_turns": float(starts.sum()) / n,
            "episode/trained_length": float(kept.completion_lengths().sum()) / n}
