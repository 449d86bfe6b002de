"""Health checks on each step's metrics: a run that collapses or blows up says so, once per check, instead of
ending with exit code 0 and a flat curve nobody looked at.

Each check watches one logged metric; it fires when the metric is bad for train.health_steps steps in a row (a
non-finite skip fires at once). A firing check is one WARNING line, `health/<check>` = 1 in the metrics of every
step it holds (0 otherwise), and an entry in summary.json's `health_warnings`. With train.stop_on_collapse the
run stops instead (exit code 3), except for non-finite skips, which train.max_nonfinite_steps already bounds.
A run slower than train.warn_seconds expects says so once too, and goes on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from podsrl.config import TrainConfig
from podsrl.errors import UnhealthyRun

log = logging.getLogger("podsrl")


@dataclass(frozen=True)
class Check:
    name: str
    metric: str
    bad: Callable[[float, TrainConfig], bool]
    message: str  # formatted with the TrainConfig as `t`, `steps` (the streak) and `value`
    collapse: bool = True  # stops the run under train.stop_on_collapse


CHECKS = (
    Check("reward_zero", "reward", lambda v, t: abs(v) < 1e-12,
          "reward has been 0 for {steps} steps: no rollout earns anything, so no group carries a learning signal "
          "(a collapsed policy, or a task too hard for this model)"),
    Check("empty_completions", "completions/mean_length", lambda v, t: v < 1.0,
          "completions have been empty for {steps} steps (mean length {value:.2f} tokens): the policy stops at "
          "once; it has collapsed"),
    Check("entropy_collapse", "entropy", lambda v, t: v < t.health_min_entropy,
          "token entropy has been below train.health_min_entropy={t.health_min_entropy:g} for {steps} steps "
          "({value:.3g}): sampling has become deterministic, so groups stop differing"),
    Check("kl_blowup", "kl", lambda v, t: v > t.health_max_kl,
          "KL to the reference has been above train.health_max_kl={t.health_max_kl:g} for {steps} steps "
          "({value:.3g}): the policy has run far from where it started"),
    Check("ratio_blowup", "clip_ratio/region_mean", lambda v, t: v > t.health_max_clipped,
          "the share of tokens with a clipped probability ratio has been above train.health_max_clipped="
          "{t.health_max_clipped:g} for {steps} steps ({value:.3g}): each update moves the policy too far"),
    Check("nonfinite_skips", "train/nonfinite_skipped", lambda v, t: v > 0,
          "an update was skipped for a non-finite loss or gradient ({value:g} skipped at this step); "
          "train.max_nonfinite_steps in a row stop the run", collapse=False),
)


class HealthMonitor:
    def __init__(self, train: TrainConfig, speak: bool = True) -> None:
        self.train, self.speak = train, speak  # speak: rank 0 alone logs (every rank sees the same metrics)
        self.streaks = dict.fromkeys((c.name for c in CHECKS), 0)
        self.warnings: list[dict] = []  # {check, step, message}, one per check that fired, for summary.json
        self.stop_message = ""
        self.warned_slow = False

    def observe(self, metrics: dict, step: int) -> dict[str, float]:
        """The `health/*` metrics of this step; warns on the step a check first fires."""
        if not self.train.health_steps:
            return {}
        out = {}
        for check in CHECKS:
            value = metrics.get(check.metric)
            bad = value is not None and math.isfinite(value) and check.bad(value, self.train)
            self.streaks[check.name] = self.streaks[check.name] + 1 if bad else 0
            needed = self.train.health_steps if check.collapse else 1
            firing = bad and self.streaks[check.name] >= needed
            out[f"health/{check.name}"] = float(firing)
            if not firing:
                continue
            message = check.message.format(t=self.train, steps=self.streaks[check.name], value=value)
            if check.collapse and self.train.stop_on_collapse and not self.stop_message:
                self.stop_message = f"training stopped at step {step} (train.stop_on_collapse): {message}"
            if any(w["check"] == check.name for w in self.warnings):
                continue
            self.warnings.append({"check": check.name, "step": step, "message": message})
            if self.speak:
                log.warning("health: step %d: %s", step, message)
        return out

    def warn_if_slow(self, elapsed: float, step: int) -> None:
        """train.warn_seconds: say once that this machine is slower than expected; the run goes on to max_steps."""
        limit = self.train.warn_seconds
        if limit and elapsed > limit and not self.warned_slow and self.speak:
            self.warned_slow = True
            eta = elapsed / step * (self.train.max_steps - step)
            log.warning("training has taken %.0f s at step %d of %d, past train.warn_seconds=%g: this machine is "
                        "slower or busier than expected. The run continues to max_steps (~%.0f s more), so its "
                        "result does not depend on the machine's speed.", elapsed, step, self.train.max_steps,
                        limit, eta)

    def stop_if_nonfinite(self, in_a_row: int, step: int, checkpoints: Path) -> None:
        """train.max_nonfinite_steps: the run stops after so many updates in a row skipped as non-finite."""
        if in_a_row >= self.train.max_nonfinite_steps:
            raise UnhealthyRun(f"training stopped: {in_a_row} consecutive steps with a non-finite loss or gradient "
                               f"(step {step}); try a lower optim.lr. The last good checkpoint is in {checkpoints}")

    def stop_if_asked(self, checkpoints: str) -> None:
        if self.stop_message:
            raise UnhealthyRun(f"{self.stop_message}. Try a lower optim.lr; the last checkpoint before it is in "
                               f"{checkpoints}")

    def state_dict(self) -> dict:
        return {"streaks": dict(self.streaks), "warnings": list(self.warnings)}

    def load_state_dict(self, state: dict) -> None:
        self.streaks.update(state.get("streaks", {}))
        self.warnings = list(state.get("warnings", []))
