"""Rebuild the comparison plot and tables from saved run dirs: results.md, results.csv, runs.csv and
accuracy.png.

`podsrl report RUN_DIR...` accepts run dirs or any folder holding them (e.g. a `podsrl compare` output dir).
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Iterable, Mapping
from pathlib import Path

from podsrl.errors import UserError
from podsrl.experiments.analysis import (
    PAIRED_METRICS,
    PAIRED_TITLES,
    STEP_TIME_KEYS,
    Comparison,
    RunResult,
    Spread,
    compare_runs,
    load_run,
)
from podsrl.experiments.expectation import binding_expectation
from podsrl.experiments.paired_test import fewest_seeds, format_p, interval_label, interval_level
from podsrl.experiments.stats import ALPHA, POWER, PairedStat, seeds_range_text
from podsrl.experiments.tokenizers import run_tokenizer, tokenizer_note

NOT_REACHED = "not reached"
HEADER_FILE = "header.md"  # written by `podsrl compare`, picked up by `podsrl report` on the same folder
TOTALS = (
    ("rollouts_generated", "total/rollouts_generated"),
    ("rollouts_trained", "total/rollouts_trained"),
    ("tokens_generated", "total/tokens_generated"),
    ("tokens_environment", "total/tokens_environment"),
    ("tokens_trained", "total/tokens_trained"),
    ("wall_clock_s", "time/elapsed"),
)


def discover_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Each path itself if it holds metrics.jsonl, else every run dir below it (hidden folders skipped)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            found.append(p)
            continue
        if not p.is_dir():
            raise UserError(f"{p}: no such run directory")
        below = sorted(
            m.parent
            for m in p.rglob("metrics.jsonl")
            if not any(part.startswith(".") for part in m.relative_to(p).parts)
        )
        if not below:
            raise UserError(f"{p}: no metrics.jsonl in it or below it")
        found.extend(below)
    return list(dict.fromkeys(found))


def _spread_columns(prefix: str, s: Spread, missing: str | None = None) -> dict:
    cols = {f"{prefix}_mean": s.mean, f"{prefix}_std": s.std, f"{prefix}_min": s.min, f"{prefix}_max": s.max}
    return {k: (missing if v is None and missing is not None else v) for k, v in cols.items()}


def comparison_rows(comparison: Comparison) -> list[dict]:
    """One row per config with raw numbers; time/speed-up cells are "not reached" when no seed got there."""
    rows = []
    for cfg in comparison.configs:
        n = len(cfg.runs)
        unreached = NOT_REACHED if cfg.time_to_target.n == 0 else None
        row: dict = {"config": cfg.label, "seeds": n}
        row |= _spread_columns("peak", cfg.peak) | _spread_columns("plateau", cfg.plateau)
        row["target"] = sum(r.target for r in cfg.runs) / n
        row |= _spread_columns("time_to_target_s", cfg.time_to_target, unreached)
        row["reached"] = f"{cfg.time_to_target.n}/{n}"
        row |= _spread_columns("rollouts_to_target", cfg.rollouts_to_target, unreached)
        row |= _spread_columns("speedup", cfg.speedup, unreached)
        row["speedup_seeds"] = cfg.speedup.n
        row |= {name: cfg.totals[key].mean if key in cfg.totals else None for name, key in TOTALS}
        row |= {f"mean_{k.replace('/', '_')}_s": cfg.step_times[k].mean for k in STEP_TIME_KEYS}
        row |= _spread_columns("final", Spread.of(x.final for x in cfg.runs))
        row |= _spread_columns("auc", Spread.of(x.auc for x in cfg.runs))
        for metric in PAIRED_METRICS:
            row |= _paired_columns(metric, cfg.paired.get(metric))
        rows.append(row)
    return rows


def _paired_columns(metric: str, p: PairedStat | None) -> dict:
    """vs-baseline columns of one metric (empty for the baseline itself)."""
    names = ("pairs", "diff", "ci_low", "ci_high", "p", "p_holm", "verdict", "verdict_words", "seeds_needed",
             "seeds_low", "seeds_high")
    values = (
        (None,) * len(names)
        if p is None
        else (p.pairs, p.mean_diff, p.ci_low, p.ci_high, p.p_value, p.p_holm, p.verdict, p.words, p.seeds_needed,
              p.seeds_low, p.seeds_high)
    )
    return {f"{metric}_{name}": v for name, v in zip(names, values)}


def verdict_lines(rows: list[dict]) -> list[str]:
    """Console summary from comparison_rows: one line per non-baseline config and paired metric."""
    lines = []
    for row in rows[1:]:
        for metric, title in PAIRED_TITLES.items():
            diff, verdict = row.get(f"{metric}_diff"), row.get(f"{metric}_verdict")
            if verdict is None:
                continue
            digits = 1 if metric == "time_to_target" else 3
            text = f"{row['config']} vs {rows[0]['config']}, {title}: "
            text += "no pairs" if diff is None else f"{diff:+.{digits}f}"
            if row[f"{metric}_ci_low"] is not None:
                text += f" [{row[f'{metric}_ci_low']:+.{digits}f}, {row[f'{metric}_ci_high']:+.{digits}f}]"
                text += f" ({interval_level(row[f'{metric}_pairs'], ALPHA)})"
            text += f" ({row[f'{metric}_pairs']} pairs) {row[f'{metric}_verdict_words']}"
            if row[f"{metric}_seeds_needed"] is not None:
                seeds = seeds_range_text(*(row[f"{metric}_seeds_{k}"] for k in ("needed", "low", "high")))
                text += f"; {seeds} seeds would resolve it (estimate from the observed spread)"
            lines.append(text)
    return lines


def paired_table(comparison: Comparison) -> str:
    """Markdown: per config and metric, mean paired difference [interval], sign-flip p, pairs, verdict, seeds."""
    rows, pairs = [], set()
    for cfg in comparison.configs[1:]:
        for metric, p in cfg.paired.items():
            digits = 1 if metric == "time_to_target" else 3
            if p.mean_diff is None:
                diff = "—"
            else:
                diff = f"{p.mean_diff:+.{digits}f}"
                if p.ci_low is not None:
                    diff += f" [{p.ci_low:+.{digits}f}, {p.ci_high:+.{digits}f}]"
                    pairs.add(p.pairs)
            needed = "—" if p.seeds_needed is None else seeds_range_text(p.seeds_needed, p.seeds_low, p.seeds_high)
            verdict = f"**{p.words}**" if p.verdict != "inconclusive" else p.words
            tested = "—" if p.p_value is None else f"{format_p(p.p_value)} ({format_p(p.p_holm)})"
            rows.append(
                [f"`{cfg.label}`", PAIRED_TITLES[metric], diff, tested, f"{p.pairs}/{p.seeds}", verdict, needed]
            )
    if not rows:
        return ""
    levels = "; ".join(interval_label(n, ALPHA) for n in sorted(pairs))
    return _table(
        [
            "config",
            "metric",
            f"mean difference vs `{comparison.baseline}` [interval: {levels or 'none'}]",
            "sign-flip p (Holm)" if comparison.expect is None else f"one-sided p for {comparison.expect} (Holm)",
            "pairs",
            "verdict",
            f"seeds to resolve (estimate from the observed spread; range from its {1 - ALPHA:.0%} interval)",
        ],
        rows,
    )


def _speedup_cell(res: RunResult, base: dict) -> str | float:
    if res.speedup is not None:
        return res.speedup
    if res.time_to_target is None:
        return NOT_REACHED
    if res.record.seed not in base:
        return "no baseline seed"
    return "baseline " + NOT_REACHED


def run_rows(comparison: Comparison) -> list[dict]:
    """One row per run (config, seed)."""
    base = {r.record.seed: r for r in comparison.configs[0].runs}
    rows = []
    for cfg in comparison.configs:
        for res in cfg.runs:
            rec = res.record
            rows.append(
                {
                    "config": cfg.label,
                    "seed": rec.seed,
                    "final": res.final,
                    "peak": res.peak,
                    "plateau": res.plateau,
                    "auc": res.auc,
                    "auc_horizon_s": res.horizon,
                    "target": res.target,
                    "time_to_target_s": NOT_REACHED if res.time_to_target is None else res.time_to_target,
                    "rollouts_to_target": NOT_REACHED
                    if res.rollouts_to_target is None
                    else res.rollouts_to_target,
                    "speedup": _speedup_cell(res, base),
                    **{name: rec.totals.get(key) for name, key in TOTALS},
                    "steps": rec.n_steps,
                    "finished": rec.finished,
                    "run_dir": str(rec.run_dir),
                }
            )
    return rows


def _num(x: float | None, digits: int) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if digits == 0 else f"{x:.{digits}f}"


def _spread_cell(s: Spread, digits: int, n_total: int | None = None, unit: str = "") -> str:
    """'mean ± std [min–max]'; 'not reached' when n_total is given and no seed has a value."""
    if s.mean is None:
        return NOT_REACHED if n_total is not None else "—"
    text = _num(s.mean, digits) + unit
    if s.n > 1:
        text += f" ± {_num(s.std, digits)} [{_num(s.min, digits)}–{_num(s.max, digits)}]"
    if n_total is not None and s.n < n_total:
        text += f" ({s.n}/{n_total} reached)"
    return text


def _cell(value: object, digits: int, unit: str = "") -> str:
    if isinstance(value, str):
        return value
    return _num(value, digits) + unit if isinstance(value, (int, float)) else "—"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def render_markdown(comparison: Comparison, header: str | None = None) -> str:
    c = comparison
    target_text = (
        f"each seed is timed to the smoothed peak of the baseline run with the same seed "
        f"(mean {c.target:.4f})"
        if c.target_mode == "per_seed"
        else f"the mean over baseline seeds of their smoothed peaks, {c.target:.4f}"
    )
    crossing = "linearly interpolated between eval points" if c.interpolate else "at the first eval point"
    method = [
        f"Baseline: `{c.baseline}`. Target: {target_text}.",
        "Accuracy is greedy pass@1 on the held-out set,",
        f"smoothed by a trailing mean over {c.smooth_window} eval(s); peak = max of the smoothed curve;",
        f"plateau = mean of the last {c.plateau_fraction:.0%} of eval points.",
        f"Time to target = training {c.clock} (eval excluded) when the smoothed curve first reaches",
        f"the target, {crossing}. Speed-up = baseline time / method time, paired by seed.",
        "Cells show mean ± std [min–max] over seeds; times and speed-ups over the seeds that reached the",
        "target (count shown when not all did).",
    ]
    two_sided = c.expect is None
    fewest = fewest_seeds(1, ALPHA, two_sided)  # one metric; all fewer seeds agreeing give this p at best
    best_p = (2 if two_sided else 1) * 0.5 ** (fewest - 1)
    test = "two-sided" if two_sided else f"one-sided for {c.expect} (named before the runs: no verdict the other way)"
    paired_note = [
        f"Paired by seed (seed s of a config minus seed s of `{c.baseline}`): mean difference with an expanded",
        "percentile bootstrap interval, at the level the header names for its number of pairs (up to 4 pairs it",
        f"is the range of the differences). p: exact sign-flip test of the mean difference, {test},",
        "Holm-corrected across the metrics in brackets; verdict better / worse when the Holm p is at",
        f"most {ALPHA} (time to target: lower is better), 'all n seeds agree' when every pair lies on one side",
        "without that, else inconclusive, with the seeds a paired t-test would need to resolve the observed",
        f"difference at the observed spread ({'two' if two_sided else 'one'}-sided {ALPHA}, power {POWER}) and the",
        "range from the spread's own uncertainty.",
        f"Final = last eval point; area = trapezoid integral of accuracy over the seed's common {c.clock}",
        "[0, T] (T = earliest end among that seed's runs) divided by T; final, peak and plateau use each run's",
        "whole curve, like for like only under an equal budget. Time to target uses the pairs where both",
        f"reached it. No result of fewer than {fewest} seeds can reach p = {ALPHA} (all {fewest - 1} agreeing has",
        f"p = {format_p(best_p)}): see docs/statistics.md.",
    ]
    parts = [header.strip() + "\n"] if header else []
    parts.append(" ".join(method) + "\n")
    tokenizers, mixed = tokenizer_note({cfg.label: [run_tokenizer(r.record.summary, r.record.config)
                                                    for r in cfg.runs] for cfg in c.configs})
    parts.append(tokenizers)
    summary = []
    # episodes: the environment's tokens (tool answers) beside the model's, never counted as generated
    environment = any((cfg.totals.get("total/tokens_environment", Spread.of([])).mean or 0) > 0 for cfg in c.configs)
    for cfg in c.configs:
        n = len(cfg.runs)
        steps = " / ".join(_num(cfg.step_times[k].mean, 3) for k in STEP_TIME_KEYS)
        tot = {key: cfg.totals.get(key, Spread.of([])).mean for _, key in TOTALS}
        speed = (
            _spread_cell(cfg.speedup, 2, len(cfg.runs), unit="×")
            if cfg.speedup.n
            else (NOT_REACHED if cfg.time_to_target.n == 0 else "—")
        )
        summary.append(
            [
                f"`{cfg.label}`",
                str(n),
                _spread_cell(cfg.peak, 3),
                _spread_cell(cfg.plateau, 3),
                _spread_cell(cfg.time_to_target, 1, n),
                _spread_cell(cfg.rollouts_to_target, 0, n),
                speed,
                f"{_num(tot['total/rollouts_generated'], 0)} / {_num(tot['total/rollouts_trained'], 0)}",
                " / ".join(_num(tot[key], 0) for key in ("total/tokens_generated", "total/tokens_environment",
                                                          "total/tokens_trained") if environment or "env" not in key),
                _num(tot["time/elapsed"], 1),
                steps,
            ]
        )
    parts.append(
        _table(
            [
                "config",
                "seeds",
                "peak acc",
                "plateau acc",
                "time to target (s)",
                "rollouts generated to target",
                "speed-up",
                "rollouts gen / trained",
                ("tokens gen / env / trained" if environment else "tokens gen / trained")
                + (" (each config's own tokenizer: not comparable)" if mixed else ""),
                f"{c.clock} (s)",
                "step time (s): generate / score / select / update / total",
            ],
            summary,
        )
    )
    per_run = [
        [
            f"`{r['config']}`",
            str(r["seed"]),
            _cell(r["final"], 3),
            _cell(r["peak"], 3),
            _cell(r["plateau"], 3),
            _cell(r["auc"], 3),
            _cell(r["target"], 3),
            _cell(r["time_to_target_s"], 1),
            _cell(r["rollouts_to_target"], 0),
            _cell(r["speedup"], 2, "×"),
            _cell(r["wall_clock_s"], 1),
            str(r["steps"]),
            "yes" if r["finished"] else "**no**",
        ]
        for r in run_rows(c)
    ]
    paired = paired_table(c)
    if paired:
        parts.append("\nPaired by seed against the baseline:\n")
        parts.append(" ".join(paired_note) + "\n")
        parts.append(paired)
    parts.append("\nPer run:\n")
    parts.append(
        _table(
            [
                "config",
                "seed",
                "final",
                "peak",
                "plateau",
                "area / T",
                "target",
                "time to target (s)",
                "rollouts generated to target",
                "speed-up",
                f"{c.clock} (s)",
                "steps",
                "finished",
            ],
            per_run,
        )
    )
    return "\n".join(parts) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)


def build_report(
    run_dirs: Iterable[str | Path],
    baseline: str | None = None,
    out_dir: str | Path = ".",
    *,
    smooth_window: int = 3,
    plateau_fraction: float = 0.2,
    target_mode: str = "per_seed",
    interpolate: bool = True,
    header: str | None = None,
    labels: Mapping[str | Path, str] | None = None,
    expect: str | None = None,
) -> list[dict]:
    """Load runs, compare them, write results.md/.csv, runs.csv and accuracy.png; return the per-config rows.

    Runs are grouped by label (config `name`, else the config's folder in compare's layout; `labels` overrides
    per run dir) and seed. The baseline is the first label seen unless named. expect: the side named before the
    runs ("better" / "worse": one-sided tests, no verdict on the other side), None for two-sided.
    """
    from podsrl.experiments.plots import plot_comparison  # matplotlib loads in seconds: only when plotting

    labels = {Path(k): v for k, v in (labels or {}).items()}
    records = [load_run(d, labels.get(Path(d))) for d in run_dirs]
    comparison = compare_runs(
        records, baseline, smooth_window, plateau_fraction, target_mode, interpolate, expect
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = comparison_rows(comparison)
    (out / "results.md").write_text(render_markdown(comparison, header), encoding="utf-8")
    write_csv(rows, out / "results.csv")
    write_csv(run_rows(comparison), out / "runs.csv")
    plot_comparison(comparison, out / "accuracy.png")
    return rows


def add_analysis_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by `compare` and `report`."""
    parser.add_argument("--baseline", help="config label to compare against (default: the first config)")
    parser.add_argument(
        "--smooth",
        type=int,
        default=3,
        metavar="W",
        help="trailing running mean over W eval points (default 3; 1 = no smoothing)",
    )
    parser.add_argument(
        "--plateau-fraction",
        type=float,
        default=0.2,
        help="plateau accuracy = mean of this last fraction of eval points (default 0.2)",
    )
    parser.add_argument(
        "--target-mode",
        choices=("per_seed", "mean"),
        default="per_seed",
        help="target = each seed's baseline peak (default) or the mean baseline peak",
    )
    parser.add_argument(
        "--no-interpolate",
        action="store_true",
        help="time to target at the first eval point at/above it (default: interpolate)",
    )
    parser.add_argument(
        "--expect",
        choices=("better", "worse"),
        help="the side you expected before the runs: one-sided tests for it, and no verdict on the other side "
        "(default: two-sided; naming a side after seeing the results doubles the false-positive rate). "
        "`podsrl compare` records it (or two-sided) in the folder's expect.json before the first run; a later "
        "compare or report on those runs keeps it and refuses another",
    )


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run dirs, or folders holding them")
    parser.add_argument(
        "--out", help="where to write the report (default: the one folder of runs given, else .)"
    )
    parser.add_argument(
        "--header-file", help=f"markdown put above the table (default: {HEADER_FILE} if found)"
    )
    add_analysis_arguments(parser)


def report_main(args: argparse.Namespace) -> int:
    """`podsrl report`: rebuild plot and tables from saved runs. Returns the exit code."""
    given = [Path(p) for p in args.run_dirs]
    # Default: into the one folder of runs given (a compare output dir), never into a run dir itself.
    single = len(given) == 1 and given[0].is_dir() and not (given[0] / "metrics.jsonl").is_file()
    out = Path(args.out) if args.out else (given[0] if single else Path("."))
    header = None
    header_path = (
        Path(args.header_file)
        if args.header_file
        else next((p / HEADER_FILE for p in given if (p / HEADER_FILE).is_file()), None)
    )
    if header_path is not None:
        if not header_path.is_file():
            raise UserError(f"--header-file {header_path}: no such file")
        header = header_path.read_text(encoding="utf-8")
    rows = build_report(
        discover_run_dirs(given),
        args.baseline,
        out,
        smooth_window=args.smooth,
        plateau_fraction=args.plateau_fraction,
        target_mode=args.target_mode,
        interpolate=not args.no_interpolate,
        header=header,
        expect=binding_expectation(given, args.expect),  # the side a compare folder's runs were started with
    )
    print("\n".join(verdict_lines(rows)))
    print(f"{len(rows)} config(s) compared; wrote {out / 'results.md'}, results.csv, runs.csv, accuracy.png")
    return 0
