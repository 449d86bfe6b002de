"""benchmarks/gpu_pods_study.sh's plumbing on the CPU (tiny sizes): warm-up, the two arms, a priming run, `podsrl compare`, the
report and the per-run step table, each part recorded in summary.txt; a run cut short by the deadline is recorded."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/gpu_pods_study.sh")


def study(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    # PYTHON: the script's interpreter is this one, whatever `python3` is on PATH
    result = subprocess.run(["bash", SCRIPT, "--smoke", "--out", str(out), "--runs", str(tmp_path / "runs"), *args],
                            capture_output=True, text=True, timeout=300, check=False,
                            env={**os.environ, "PYTHON": sys.executable})
    return result, out


def test_smoke_study_runs_every_part_and_writes_the_report(tmp_path):
    result, out = study(tmp_path, "--seeds", "1 2")
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.txt").read_text()
    for part in ("warmup: ok", "prime: ok", "compare: ok", "steps: written", "gpu_pods_study: done"):
        assert part in summary, summary
    assert '"validation_accuracy"' in summary  # the warm-up's outcome
    assert sorted(p.name for p in out.iterdir()) == ["accuracy.png", "log.txt", "results.csv", "results.md",
                                                     "runs.csv", "steps.md", "summary.txt"]
    report = (out / "results.md").read_text()
    assert "Baseline: `grpo_2`" in report and "| `pods_4to2` | final acc |" in report
    rows = (out / "steps.md").read_text().splitlines()[2:]
    assert [r.split(" | ")[:2] for r in rows] == [["| grpo_2", "seed1"], ["| grpo_2", "seed2"],
                                                  ["| pods_4to2", "seed1"], ["| pods_4to2", "seed2"]]
    assert all(r.split(" | ")[7].endswith("%") for r in rows)  # the generation share
    assert "== grpo_2-seed1.log" in (out / "log.txt").read_text()
    arms = {p.name: p.read_text() for p in (tmp_path / "runs/arms").iterdir()}
    assert "method: grpo" in arms["grpo_2.yaml"] and "pods:" not in arms["grpo_2.yaml"]
    assert "method: pods" in arms["pods_4to2.yaml"] and "m: 2" in arms["pods_4to2.yaml"]


def test_a_compare_past_the_deadline_is_recorded_as_timed_out(tmp_path):
    result, out = study(tmp_path, "--seeds", "1", "--deadline", "1")
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.txt").read_text()
    assert "warmup: ok" in summary and "compare: TIMED OUT at 1s" in summary and "gpu_pods_study: done" in summary


def test_unknown_argument_is_refused():
    bad = subprocess.run(["bash", SCRIPT, "--bogus"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr
