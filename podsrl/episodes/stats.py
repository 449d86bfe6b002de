"""What a step's episodes did, counted over every generate call of the step, and its metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

ENDINGS = ("answer", "turns", "tokens", "environment_fault")  # why an episode ended


@dataclass
class EpisodeStats:
    episodes: int = 0
    turns: int = 0
    endings: Counter = field(default_factory=Counter)  # ENDINGS -> episodes
    tool_calls: Counter = field(default_factory=Counter)  # tool name -> calls
    tool_faults: Counter = field(default_factory=Counter)  # tool name -> faulty calls

    def add(self, other: EpisodeStats) -> None:
        self.episodes += other.episodes
        self.turns += other.turns
        self.endings.update(other.endings)
        self.tool_calls.update(other.tool_calls)
        self.tool_faults.update(other.tool_faults)

    def metrics(self) -> dict[str, float]:
        """Per-episode means and shares, and the step's counts of tool calls and faults (in total and per tool)."""
        n = max(self.episodes, 1)
        out = {"episode/turns": self.turns / n,
               "episode/tool_calls": float(sum(self.tool_calls.values())),
               "episode/tool_faults": float(sum(self.tool_faults.values()))}
        out.update({f"episode/ended_by_{e}": self.endings[e] / n for e in ENDINGS})
        for name in sorted(self.tool_calls):
            out[f"episode/tool_calls/{name}"] = float(self.tool_calls[name])
            out[f"episode/tool_faults/{name}"] = float(self.tool_faults[name])
        return out
