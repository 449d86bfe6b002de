"""`podsrl compare`: train every config × seed under one budget, then plot and tabulate.

Runs go one at a time, seed-major (all configs for seed 1, then seed 2, ...), so a comparison stopped half-way
still holds comparable pairs. Each run is a subprocess `python -m podsrl train ...` with its output in
out_dir/logs/; run dirs are out_dir/<config stem>/seed<s>. Calling it again continues: finished runs
(summary.json) are skipped, runs with a checkpoint are resumed with `--resume`, and others start over (the
stale partial dir is moved to a hidden `.seed<s>.stale<k>` folder that reports ignore). Same warm-up
checkpoint and held-out set across runs are the trainer's job; every run gets the same overrides.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

from podsrl.config.presets import preset_path
from podsrl.errors import UserError
from podsrl.experiments.expectation import record_expectation
from podsrl.experiments.report import HEADER_FILE, add_analysis_arguments, build_report, verdict_lines
from podsrl.run.lock import LOCK_FILE, RunLock

_POLL_SECONDS = 0.5
_LOG_TAIL_LINES = 15


@dataclass
class RunOutcome:
    label: str
    seed: int
    run_dir: Path
    status: str  # "skipped" (finished before), "finished", "resumed" (then finished), "failed"
    returncode: int | None = None
    log_path: Path | None = None
    message: str = ""


@dataclass
class CompareResult:
    outcomes: list[RunOutcome] = field(default_factory=list)
    rows: list[dict] | None = None  # per-config report rows; None when no report could be built
    report_error: str | None = None

    @property
    def failures(self) -> list[RunOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failures and self.report_error is None


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def train_argv(
    prefix: Sequence[str],
    config: Path,
    seed: int,
    run_dir: Path,
    budget_seconds: float | None,
    budget_rollouts: int | None,
    overrides: Sequence[str],
    resume: bool,
) -> list[str]:
    """The trainer command line for one run (the same overrides on a fresh start and on a resume)."""
    argv = [*prefix, "train", "--config", str(config)]
    if resume:
        argv += ["--resume", str(run_dir)]
    argv += [f"seed={seed}", f"output_dir={run_dir}"]
    if budget_seconds is not None:
        argv.append(f"train.max_seconds={_number(budget_seconds)}")
    if budget_rollouts is not None:
        argv.append(f"train.max_rollouts={int(budget_rollouts)}")
    return argv + list(overrides)


def run_state(run_dir: Path) -> str:
    """'finished' (summary.json), 'resume' (a checkpoint exists) or 'fresh'."""
    if (run_dir / "summary.json").is_file():
        return "finished"
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return "resume"
    return "fresh"


def _move_aside(run_dir: Path) -> None:
    """Keep a partial run without checkpoint for inspection, out of the way of the new run and of reports."""
    if not run_dir.exists() or all(p.name == LOCK_FILE for p in run_dir.iterdir()):
        return
    k = 1
    while (stale := run_dir.with_name(f".{run_dir.name}.stale{k}")).exists():
        k += 1
    run_dir.rename(stale)


class _Progress:
    """Rich display: an overall bar over runs and a bar for the current run (its time/elapsed or rollouts)."""

    def __init__(self, enabled: bool, total_runs: int, budget: tuple[str, float] | None, console: Console):
        self.console = console
        self.budget_key, self.budget_total = budget if budget else ("time/elapsed", None)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
        )
        self.overall = self.progress.add_task("runs", total=total_runs)
        self.current = self.progress.add_task("", total=self.budget_total, visible=False)
        self._offset = 0

    def start_run(self, name: str, metrics: Path) -> None:
        self._offset = metrics.stat().st_size if metrics.is_file() else 0
        self.progress.reset(self.current, total=self.budget_total, description=name, visible=True)
        self.poll(metrics)

    def poll(self, metrics: Path) -> None:
        """Read metrics lines appended since the last poll and move the current-run bar."""
        if not metrics.is_file():
            return
        with metrics.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # only complete lines
        self._offset += end
        for line in chunk[:end].splitlines():
            try:
                value = json.loads(line).get(self.budget_key)
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(value, (int, float)):
                self.progress.update(self.current, completed=value)

    def end_run(self) -> None:
        self.progress.update(self.current, visible=False)
        self.progress.advance(self.overall)


def _run_one(argv: list[str], log_path: Path, metrics: Path, display: _Progress) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"\n$ {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            while True:
                try:
                    return proc.wait(timeout=_POLL_SECONDS)
                except subprocess.TimeoutExpired:
                    display.poll(metrics)
        finally:
            if proc.poll() is None:  # interrupted (Ctrl-C): stop our child; the next call resumes it
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _tail(path: Path, n: int = _LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _gpu_names() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        names = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.split(
            "\n"
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return ", ".join(n.strip() for n in names if n.strip())


def compare_header(
    configs: Sequence[Path],
    seeds: Sequence[int],
    budget_seconds: float | None,
    budget_rollouts: int | None,
    overrides: Sequence[str],
    command: str | None,
    expect: str | None = None,
) -> str:
    """Markdown lines naming the machine, the commands and the side expected, for the top of results.md."""
    try:  # torch's version without importing it (seconds); the GPU from nvidia-smi when there is one
        torch_text = f"torch {importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        torch_text = "torch not installed"
    gpus = _gpu_names()
    torch_text += f", GPU: {gpus}" if gpus else ", no GPU"
    budget = (
        ", ".join(
            b
            for b in (
                budget_seconds is not None and f"train.max_seconds={_number(budget_seconds)}",
                budget_rollouts is not None and f"train.max_rollouts={budget_rollouts}",
            )
            if b
        )
        or "each config's own limits"
    )
    lines = [
        "# podsrl compare",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        (
            f"- machine: {platform.node()}, {platform.platform()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, {torch_text}"
        ),
        f"- configs: {', '.join(str(c) for c in configs)}; seeds: {', '.join(map(str, seeds))}",
        f"- budget per run: {budget}; overrides: {' '.join(overrides) or 'none'}",
        "- side named before the runs: "
        + (f"{expect} (one-sided tests)" if expect else "none (two-sided tests)"),
    ]
    if command:
        lines.append(f"- command: `{command}`")
    return "\n".join(lines) + "\n"


def run_compare(
    config_paths: Sequence[str | Path],
    seeds: Sequence[int],
    out_dir: str | Path,
    budget_seconds: float | None = None,
    budget_rollouts: int | None = None,
    extra_overrides: Sequence[str] = (),
    train_command: Sequence[str] | None = None,
    progress: bool = True,
    *,
    baseline: str | None = None,
    report_options: dict | None = None,
    command: str | None = None,
    console: Console | None = None,
) -> CompareResult:
    """Train each config × seed (skipping finished runs, resuming interrupted ones), then write the report.

    `train_command` replaces the `[python, -m, podsrl]` prefix (e.g. `torchrun --nproc-per-node 2 -m podsrl`,
    or a fake trainer in tests). `report_options` go to `build_report` (smooth_window, target_mode, ...). A
    failing run is reported with its log tail and the others go on; `CompareResult.ok` is False at the end.
    """
    configs = [Path(p) for p in config_paths]
    for c in configs:
        if not c.is_file():
            raise UserError(f"config {c}: no such file")
    labels = [c.stem for c in configs]
    if len(set(labels)) != len(labels):
        raise UserError(
            f"config file names must differ (runs are stored by name): {', '.join(map(str, configs))}"
        )
    if not seeds:
        raise UserError("--seeds: give at least one seed")
    if baseline is not None:
        baseline = Path(baseline).stem if baseline.endswith((".yaml", ".yml")) else baseline
        if baseline not in labels:
            raise UserError(f"--baseline {baseline!r} is not one of the configs: {', '.join(labels)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the side is fixed with the folder's first runs: a later compare or report on them tests the same one
    report_options = {**(report_options or {})}
    report_options["expect"] = record_expectation(out, report_options.get("expect"))
    header = compare_header(
        configs, seeds, budget_seconds, budget_rollouts, extra_overrides, command, report_options["expect"]
    )
    (out / HEADER_FILE).write_text(header, encoding="utf-8")
    prefix = list(train_command) if train_command else [sys.executable, "-m", "podsrl"]
    console = console or Console(stderr=True)
    budget = (
        ("time/elapsed", budget_seconds)
        if budget_seconds is not None
        else (("total/rollouts_generated", budget_rollouts) if budget_rollouts is not None else None)
    )
    result = CompareResult()
    display = _Progress(progress, len(configs) * len(seeds), budget, console)
    with display.progress:
        for seed in seeds:
            for config, label in zip(configs, labels):
                run_dir = out / label / f"seed{seed}"
                outcome = RunOutcome(
                    label, seed, run_dir, "skipped", log_path=out / "logs" / f"{label}-seed{seed}.log"
                )
                try:  # held while deciding and moving aside; the trainer takes it again for the run itself
                    with RunLock(run_dir):
                        state = run_state(run_dir)
                        if state == "fresh":
                            _move_aside(run_dir)
                except UserError as exc:  # another process writes this run: leave it alone
                    state, outcome.status, outcome.message = "locked", "failed", f"{label} seed {seed}: {exc}"
                    console.print(f"[bold red]{outcome.message}[/bold red]")
                if state == "finished":
                    console.print(f"[dim]{label} seed {seed}: finished before, skipped[/dim]")
                elif state != "locked":
                    argv = train_argv(
                        prefix,
                        config,
                        seed,
                        run_dir,
                        budget_seconds,
                        budget_rollouts,
                        extra_overrides,
                        resume=state == "resume",
                    )
                    display.start_run(
                        f"{label} seed {seed}" + (" (resumed)" if state == "resume" else ""),
                        run_dir / "metrics.jsonl",
                    )
                    rc = _run_one(argv, outcome.log_path, run_dir / "metrics.jsonl", display)
                    outcome.returncode = rc
                    if rc == 0 and run_state(run_dir) == "finished":
                        outcome.status = "resumed" if state == "resume" else "finished"
                        console.print(f"[green]{label} seed {seed}: {outcome.status}[/green]")
                    else:
                        outcome.status = "failed"
                        why = f"exit code {rc}" if rc != 0 else "exited 0 but wrote no summary.json"
                        outcome.message = f"{label} seed {seed} failed ({why}); log: {outcome.log_path}"
                        console.print(f"[bold red]{outcome.message}[/bold red]")
                        console.print(_tail(outcome.log_path), markup=False, highlight=False)
                display.end_run()
                result.outcomes.append(outcome)

    finished = {o.run_dir: o.label for o in result.outcomes if run_state(o.run_dir) == "finished"}
    if not finished:
        result.report_error = "no run finished; nothing to report"
    else:
        try:
            result.rows = build_report(
                list(finished), baseline, out, header=header, labels=finished, **report_options
            )
        except UserError as exc:
            result.report_error = str(exc)
    if result.report_error:
        console.print(f"[bold red]report not written: {result.report_error}[/bold red]")
    else:
        for line in verdict_lines(result.rows or []):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        console.print(f"report: {out / 'results.md'}, {out / 'accuracy.png'}")
    if result.failures:
        console.print(
            f"[bold red]{len(result.failures)} run(s) failed:[/bold red] "
            + ", ".join(f"{o.label} seed {o.seed}" for o in result.failures)
        )
    return result


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "items",
        nargs="+",
        metavar="CONFIG_OR_OVERRIDE",
        help="config YAML files or bundled preset names (`podsrl presets`), then key=value overrides applied to "
        "every run",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds (default: 1 2 3)")
    parser.add_argument("--out", default="runs/compare", help="output folder (default: runs/compare)")
    parser.add_argument(
        "--budget-seconds", type=float, help="train.max_seconds for every run (equal wall-clock)"
    )
    parser.add_argument(
        "--budget-rollouts", type=int, help="train.max_rollouts for every run (equal rollouts)"
    )
    parser.add_argument(
        "--train-command",
        help="command replacing 'python -m podsrl', e.g. 'torchrun --nproc-per-node 2 -m podsrl'",
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress display")
    add_analysis_arguments(parser)


def compare_main(args: argparse.Namespace) -> int:
    """`podsrl compare`: returns 0 when every run finished and the report was written, else 1."""
    configs = [preset_path(i, "podsrl compare") for i in args.items if "=" not in i]
    overrides = [i for i in args.items if "=" in i]
    if not configs:
        raise UserError("podsrl compare: give at least one config YAML file or preset name")
    result = run_compare(
        configs,
        args.seeds,
        args.out,
        args.budget_seconds,
        args.budget_rollouts,
        overrides,
        shlex.split(args.train_command) if args.train_command else None,
        not args.no_progress,
        baseline=args.baseline,
        report_options={
            "smooth_window": args.smooth,
            "plateau_fraction": args.plateau_fraction,
            "target_mode": args.target_mode,
            "interpolate": not args.no_interpolate,
            "expect": args.expect,
        },
        command=shlex.join(["podsrl", *sys.argv[1:]]) if sys.argv[1:2] == ["compare"] else None,
    )
    return 0 if result.ok else 1
