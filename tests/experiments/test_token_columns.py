"""`podsrl compare`'s token columns: generated tokens are the model's; an episode task's environment tokens (tool
answers) are a column of their own (`total/tokens_environment`), shown only where a run has some."""

from __future__ import annotations

import csv
import json

from podsrl.experiments.report import build_report
from tests.experiments.test_experiments import PODS_T, make_runs


def add_environment_tokens(run_dir, per_step: int) -> None:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        r["total/tokens_environment"] = per_step * r["step"]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def summary_line(md: str, config: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(f"| `{config}` |"))


def test_environment_tokens_get_their_own_column_beside_the_models(tmp_path):
    dirs = make_runs(tmp_path / "runs")
    for d in dirs:
        add_environment_tokens(d, 300 if "pods" in str(d) else 0)
    build_report(dirs, out_dir=tmp_path / "out", smooth_window=1, plateau_fraction=0.4)
    md = (tmp_path / "out" / "results.md").read_text()
    assert "tokens gen / env / trained" in md
    steps = len(PODS_T) - 1  # the last step's totals: 400 model, 300 environment and 100 trained tokens a step
    assert f"{400 * steps} / {300 * steps} / {100 * steps}" in summary_line(md, "pods").replace(",", "")
    with (tmp_path / "out" / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["config"]: float(r["tokens_environment"]) for r in rows}["pods"] == 300 * steps


def test_a_comparison_without_environment_tokens_keeps_its_columns(tmp_path):
    build_report(make_runs(tmp_path / "runs"), out_dir=tmp_path / "out", smooth_window=1, plateau_fraction=0.4)
    md = (tmp_path / "out" / "results.md").read_text()
    assert "tokens gen / trained" in md and "env" not in md.split("tokens gen")[1].split("|")[0]
