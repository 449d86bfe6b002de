"""`podsrl plan CONFIG`: measure this machine's step costs with this model and task, predict candidate settings.

A step of a generate-n-train-m method (GRPO: m = n; PODS: m < n) is modelled phase by phase, each phase linear
in the work it does, with its own fixed cost:

    generate      = g0 + g1 * generated tokens            (time/generate)
    score+select  = s0 + s1 * generated rollouts          (time/score + time/select)
    update        = u0 + u1 * trained tokens * epochs      (time/update)
    other         = the rest of time/step, a constant      (batch building, weight sync, bookkeeping)

The coefficients are non-negative least-squares fits over the per-setting medians of real steps (the trainer's own
`train_step`) at four settings that span the candidates: high and low prompts per step, n and m, so that generated
and trained work vary apart. Tokens per rollout (generated and trained) are the measured means. Each setting runs in
its own trainer, the settings' steps interleaved round-robin (`--sequential`: one after the other, one model in
memory); each trainer's first step is discarded (allocator and thread-pool warm-up). The prediction is then checked against the candidates' own measured steps: the
relative error of the median step time is reported.

At equal wall-clock a method with step time t takes t_base / t as many steps as the baseline (the first
candidate), so to end level it must gain t / t_base times the baseline's held-out accuracy per step: the
"break-even gain" column.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from podsrl.errors import UserError

log = logging.getLogger("podsrl")
ERROR_AIM = 0.15


@dataclass(frozen=True)
class Setting:
    """Prompts per step, rollouts generated per prompt (n) and trained per prompt (m <= n; m = n is GRPO)."""

    prompts: int
    n: int
    m: int

    def __post_init__(self) -> None:
        if self.prompts < 1 or not 2 <= self.m <= self.n:
            raise UserError(f"candidate {self.label}: need prompts >= 1 and 2 <= m <= n (a group needs 2 rollouts)")

    @property
    def label(self) -> str:
        return f"{self.prompts}x{self.n}" + (f"->{self.m}" if self.m != self.n else "")

    @classmethod
    def parse(cls, text: str) -> Setting:
        """'32x16' (GRPO) or '32x64:16' / '32x64->16' (generate 64, train 16 per prompt)."""
        match = re.fullmatch(r"\s*(\d+)x(\d+)(?:(?::|->)(\d+))?\s*", text)
        if not match:
            raise UserError(f"candidate {text!r}: write PROMPTSxN (GRPO) or PROMPTSxN:M (train M of N)")
        p, n, m = match.groups()
        if not (int(p) >= 1 and 2 <= int(m or n) <= int(n)):
            raise UserError(f"candidate {text!r}: need prompts >= 1 and 2 <= m <= n (a group needs 2 rollouts)")
        return cls(int(p), int(n), int(m) if m else int(n))


def default_candidates(prompts: int, m: int) -> list[Setting]:
    """GRPO P x m, and PODS in both framings: P x 4m -> m (equal prompts), P/4 x 4m -> m (equal generation)."""
    return [Setting(prompts, m, m), Setting(prompts, 4 * m, m), Setting(max(1, prompts // 4), 4 * m, m)]


def design(candidates: Sequence[Setting]) -> list[Setting]:
    """Four fit settings spanning the candidates: (P_hi, n_hi, m_hi), (P_hi, n_hi, m_lo), (P_lo, n_hi, m_hi),
    (P_lo, n_lo, m_lo): highest and lowest values over the candidates, a quarter of the highest where they do not
    differ; m_lo a quarter of the lowest m (at least 2), so trained work varies apart from generated work."""
    p_hi, n_hi, m_hi = (max(getattr(c, k) for c in candidates) for k in ("prompts", "n", "m"))
    p_lo = min(c.prompts for c in candidates)
    p_lo = p_lo if p_lo < p_hi else max(1, p_hi // 4)
    n_lo = min(c.n for c in candidates)
    n_lo = n_lo if n_lo < n_hi else max(2, n_hi // 4)
    m_lo = max(2, min(c.m for c in candidates) // 4)
    m_hi = m_hi if m_hi > m_lo else min(n_hi, 4 * m_lo)
    if p_lo == p_hi or m_lo >= m_hi:
        raise UserError("podsrl plan needs room to vary the step: prompts per step >= 2 and n >= 3")
    return [
        Setting(p_hi, n_hi, min(m_hi, n_hi)),
        Setting(p_hi, n_hi, m_lo),
        Setting(p_lo, n_hi, min(m_hi, n_hi)),
        Setting(p_lo, n_lo, min(m_lo, n_lo)),
    ]


@dataclass(frozen=True)
class StepSample:
    """One measured step: its setting, the work it did and its phase times (seconds)."""

    setting: Setting
    generated_rollouts: float
    generated_tokens: float
    trained_tokens: float  # times the update passes (optim.epochs)
    generate: float
    score_select: float
    update: float
    step: float

    @property
    def other(self) -> float:
        return self.step - self.generate - self.score_select - self.update

    @classmethod
    def from_metrics(cls, setting: Setting, metrics: dict, epochs: int) -> StepSample:
        return cls(
            setting=setting,
            generated_rollouts=metrics["rollouts/generated"],
            generated_tokens=metrics["tokens/generated"],
            trained_tokens=metrics["tokens/trained"] * epochs,
            generate=metrics["time/generate"],
            score_select=metrics["time/score"] + metrics["time/select"],
            update=metrics["time/update"],
            step=metrics["time/step"],
        )


def nnls(a: np.ndarray, y: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """argmin ||a x - y|| subject to x >= 0 (Lawson and Hanson's active-set algorithm; a has a few columns).

    Coefficients enter the passive set one at a time (the one whose gradient most wants to grow); a least-squares
    solve over the passive set that would make one negative steps back to the boundary and drops it."""
    a, y = np.asarray(a, dtype=float), np.asarray(y, dtype=float)
    cols = a.shape[1]
    x = np.zeros(cols)
    passive = np.zeros(cols, dtype=bool)
    scale = tol * max(1.0, float(np.abs(a).max()) * float(np.abs(y).max()))
    for _ in range(3 * cols + 10):  # terminates in at most a few passes per column
        gradient = a.T @ (y - a @ x)
        if passive.all() or gradient[~passive].max() <= scale:
            break
        passive[np.flatnonzero(~passive)[np.argmax(gradient[~passive])]] = True
        while True:
            z = np.zeros(cols)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # step from x towards z as far as every coefficient stays >= 0, then drop those that reached 0
            blocked = np.flatnonzero(passive & (z <= 0))
            ratios = x[blocked] / (x[blocked] - z[blocked])
            x = x + ratios.min() * (z - x)
            x[blocked[np.argmin(ratios)]] = 0.0
            passive &= x > 0
            x[~passive] = 0.0
    return x


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x with a, b >= 0 (a phase cannot cost negative time, and an
    unconstrained fit over a few noisy medians can go below zero: -0.019 s per step was seen); x must take at least
    two distinct values."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xs) != len(ys) or len(set(xs.tolist())) < 2:
        raise ValueError(f"a line fit needs >= 2 distinct x values, got {sorted(set(xs.tolist()))}")
    a, b = nnls(np.stack([np.ones_like(xs), xs], axis=1), ys)
    return float(a), float(b)


@dataclass(frozen=True)
class CostModel:
    generate: tuple[float, float]  # (s per step, s per generated token)
    score_select: tuple[float, float]  # (s per step, s per generated rollout)
    update: tuple[float, float]  # (s per step, s per trained token-pass)
    other: float  # s per step
    tokens_per_generated: float  # mean completion tokens of a generated rollout
    tokens_per_trained: float  # mean completion tokens of a trained rollout, times the update passes

    @classmethod
    def fit(cls, samples: Sequence[StepSample]) -> CostModel:
        """Fit the phase lines over the settings, each entering as the medians of its steps: one step slowed by
        the machine's load moves a median little, where it would pull a fit over every step."""
        groups: dict[Setting, list[StepSample]] = {}
        for s in samples:
            groups.setdefault(s.setting, []).append(s)
        keys = ("generated_rollouts", "generated_tokens", "trained_tokens", "generate", "score_select", "update",
                "other")
        med = [{k: float(np.median([getattr(s, k) for s in g])) for k in keys} for g in groups.values()]
        trained_rollouts = [setting.prompts * setting.m for setting in groups]
        return cls(
            generate=fit_line([r["generated_tokens"] for r in med], [r["generate"] for r in med]),
            score_select=fit_line([r["generated_rollouts"] for r in med], [r["score_select"] for r in med]),
            update=fit_line([r["trained_tokens"] for r in med], [r["update"] for r in med]),
            other=max(0.0, float(np.mean([r["other"] for r in med]))),
            tokens_per_generated=sum(r["generated_tokens"] for r in med) / sum(r["generated_rollouts"] for r in med),
            tokens_per_trained=sum(r["trained_tokens"] for r in med) / sum(trained_rollouts),
        )

    def predict(self, setting: Setting) -> dict[str, float]:
        """Predicted seconds of each phase and of the step ('step')."""
        generated = setting.prompts * setting.n
        trained = setting.prompts * setting.m
        out = {
            "generate": self.generate[0] + self.generate[1] * generated * self.tokens_per_generated,
            "score_select": self.score_select[0] + self.score_select[1] * generated,
            "update": self.update[0] + self.update[1] * trained * self.tokens_per_trained,
            "other": self.other,
        }
        out["step"] = sum(out.values())
        return out


def _method_overrides(setting: Setting) -> list[str]:
    """Overrides making a config generate n and train m per prompt (GRPO for m = n), zero-variance filter off."""
    method = ["method=grpo"] if setting.m == setting.n else [
        "method=pods", f"pods.m={setting.m}", "pods.rule=max_variance"]
    return [f"rollout.prompts_per_step={setting.prompts}", f"rollout.n={setting.n}", *method,
            "filter.zero_variance=false"]


def round_order(settings: int, round_index: int) -> list[int]:
    """The settings' order in one interleaved round: round r starts at setting r mod count (benchmarks/timing.py's
    rule), so no setting always runs first or right after the same neighbour."""
    k = round_index % settings
    return [*range(k, settings), *range(k)]


def measure(
    config: Path,
    overrides: Sequence[str],
    settings: Sequence[Setting],
    steps: int,
    warm: int = 1,
    interleave: bool = True,
) -> list[list[StepSample]]:
    """`warm + steps` training steps of each setting in a trainer of its own; the last `steps` of each are kept.

    Interleaved by default: every trainer is built first and the steps go round-robin (`round_order`), so a change
    in the machine's load falls on every setting alike instead of on whichever ran then; it holds one model and
    optimiser per setting in memory. `interleave=False` runs one setting after the other (one model in memory).
    """
    from podsrl.config import load_config
    from podsrl.run.trainer import Trainer

    epochs = [1] * len(settings)  # update passes over the trained batch (optim.epochs), per setting

    def build(i: int, setting: Setting):
        log.info("plan: building %s (%d of %d)", setting.label, i + 1, len(settings))
        cfg = load_config(config, [*overrides, *_method_overrides(setting), f"output_dir={tmp}/{i}"])
        epochs[i] = cfg.optim.epochs
        return Trainer(cfg)

    metrics: list[list[dict]] = [[] for _ in settings]
    with tempfile.TemporaryDirectory(prefix="podsrl-plan-") as tmp:
        if not interleave:
            for i, setting in enumerate(settings):
                trainer = build(i, setting)
                try:
                    metrics[i] = [trainer.train_step().metrics for _ in range(warm + steps)]
                finally:
                    trainer.close()
        else:
            trainers = []
            try:
                for i, setting in enumerate(settings):
                    trainers.append(build(i, setting))
                for r in range(warm + steps):
                    log.info("plan: round %d of %d", r + 1, warm + steps)
                    for i in round_order(len(trainers), r):
                        metrics[i].append(trainers[i].train_step().metrics)
            finally:  # the last built first: each gives back the torch threads it found (train.async)
                for trainer in reversed(trainers):
                    trainer.close()
    return [
        [StepSample.from_metrics(setting, m, passes) for m in ms[warm:]]
        for setting, ms, passes in zip(settings, metrics, epochs)
    ]


@dataclass
class CandidateRow:
    setting: Setting
    predicted: dict[str, float]
    generation_share: float  # predicted generate / predicted step
    break_even_gain: float  # predicted step / predicted baseline step
    measured: float | None = None  # median measured step time
    measured_spread: tuple[float, float] | None = None  # min, max
    error: float | None = None  # predicted / measured - 1


@dataclass
class PlanResult:
    model: CostModel
    fit_samples: list[StepSample]
    rows: list[CandidateRow]
    seconds: float
    machine: str  # cores, torch threads and version, load average: the conditions of the measurement

    @property
    def max_abs_error(self) -> float | None:
        errors = [abs(r.error) for r in self.rows if r.error is not None]
        return max(errors) if errors else None


def make_plan(
    model: CostModel, candidates: Sequence[Setting], measured: dict[Setting, list[StepSample]] | None = None
) -> list[CandidateRow]:
    """Predicted step time, generation share and break-even gain of each candidate (the first is the baseline)."""
    base = model.predict(candidates[0])["step"]
    rows = []
    for c in candidates:
        pred = model.predict(c)
        row = CandidateRow(c, pred, pred["generate"] / pred["step"], pred["step"] / base)
        if measured and measured.get(c):
            times = [s.step for s in measured[c]]
            row.measured = statistics.median(times)
            row.measured_spread = (min(times), max(times))
            row.error = pred["step"] / row.measured - 1
        rows.append(row)
    return rows


def run_plan(
    config: Path,
    overrides: Sequence[str],
    candidates: Sequence[Setting],
    steps: int = 3,
    validate: bool = True,
    interleave: bool = True,
) -> PlanResult:
    t0 = time.perf_counter()
    fit_settings = design(candidates)
    # The candidates run in trainers of their own after the fit's: their steps are out of sample even where a
    # candidate is also a fit setting.
    measured = measure(
        config, overrides, [*fit_settings, *(candidates if validate else [])], steps, interleave=interleave
    )
    fit_samples = [s for runs in measured[: len(fit_settings)] for s in runs]
    model = CostModel.fit(fit_samples)
    validation = dict(zip(candidates, measured[len(fit_settings):])) if validate else None
    rows = make_plan(model, candidates, validation)
    return PlanResult(model, fit_samples, rows, time.perf_counter() - t0, machine_line())


def machine_line() -> str:
    import torch

    try:
        load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return (f"machine: {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
            f"load average {load} (1/5/15 min) at the end of the measurement")


def render(result: PlanResult, config: str) -> str:
    m = result.model
    lines = [
        f"podsrl plan {config}: {len(result.fit_samples)} fit steps at "
        + ", ".join(dict.fromkeys(s.setting.label for s in result.fit_samples))
        + f" ({result.seconds:.0f} s in all)",
        result.machine,
        "Fitted costs on this machine (non-negative least squares over each fit setting's median step):",
        f"  generation: {m.generate[1] * 1e3:.3f} ms per generated token + {m.generate[0]:.3f} s per step "
        f"({m.tokens_per_generated:.1f} tokens per rollout)",
        f"  update:     {m.update[1] * 1e3:.3f} ms per trained token-pass + {m.update[0]:.3f} s per step "
        f"({m.tokens_per_trained:.1f} token-passes per trained rollout)",
        f"  score+select: {m.score_select[1] * 1e3:.3f} ms per rollout + {m.score_select[0]:.3f} s per step;"
        f" other fixed: {m.other:.3f} s per step",
        "",
        "| candidate | generated / trained rollouts | predicted step (s) | generation share | break-even gain"
        " | measured step (s), median [min-max] | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        s = r.setting
        measured = (
            "—"
            if r.measured is None
            else f"{r.measured:.3f} [{r.measured_spread[0]:.3f}-{r.measured_spread[1]:.3f}]"
        )
        error = "—" if r.error is None else f"{r.error:+.1%}"
        lines.append(
            f"| {s.label} | {s.prompts * s.n} / {s.prompts * s.m} | {r.predicted['step']:.3f} | "
            f"{r.generation_share:.0%} | {r.break_even_gain:.2f}× | {measured} | {error} |"
        )
    lines.append("")
    lines.append(
        f"Break-even gain: at equal wall-clock a candidate must raise held-out accuracy per step this many times "
        f"as much as {result.rows[0].setting.label} (the first candidate) to end level with it."
    )
    worst = result.max_abs_error
    if worst is not None:
        verdict = "within" if worst <= ERROR_AIM else "OUTSIDE"
        lines.append(f"Largest prediction error on the measured candidates: {worst:.1%} ({verdict} the "
                     f"{ERROR_AIM:.0%} aim; the machine's load at the time counts).")
    return "\n".join(lines) + "\n"


def to_json(result: PlanResult) -> dict:
    return {
        "model": asdict(result.model),
        "fit_steps": [asdict(s) | {"setting": s.setting.label} for s in result.fit_samples],
        "candidates": [
            {
                "setting": r.setting.label,
                "predicted": r.predicted,
                "generation_share": r.generation_share,
                "break_even_gain": r.break_even_gain,
                "measured_median": r.measured,
                "measured_spread": r.measured_spread,
                "error": r.error,
            }
            for r in result.rows
        ],
        "seconds": result.seconds,
        "machine": result.machine,
    }


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config or bundled preset name (the model, task and engine measured)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.device=cuda")
    parser.add_argument(
        "--candidates",
        nargs="+",
        metavar="PxN[:M]",
        help="settings to predict, first = baseline (default: GRPO Pxm, PODS Px4m:m and P/4x4m:m from the "
        "config's prompts per step P and m)",
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps per setting (default 3, +1 warm-up)")
    parser.add_argument("--no-validate", action="store_true", help="skip measuring the candidates themselves")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="run the settings one after the other (one model in memory) instead of the default: every setting's "
        "trainer built first and stepped round-robin, steadier on a shared machine",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the fit and the predictions as JSON")


def plan_main(args: argparse.Namespace, config: Path) -> int:
    from podsrl.config import load_config
    from podsrl.methods import METHODS

    if args.steps < 1:
        raise UserError("--steps: need at least 1")
    if args.candidates:
        candidates = [Setting.parse(c) for c in args.candidates]
    else:
        cfg = load_config(config, args.overrides)
        candidates = default_candidates(cfg.rollout.prompts_per_step, METHODS[cfg.method].trained_per_prompt(cfg))
    result = run_plan(config, args.overrides, candidates, args.steps, not args.no_validate, not args.sequential)
    print(render(result, args.config), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(result), indent=1), encoding="utf-8")
    return 0
