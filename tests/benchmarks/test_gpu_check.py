"""benchmarks/gpu_check.sh's plumbing on the CPU (--smoke: tiny sizes): every part runs and is recorded, what comes
back fits a device call (at most 8 files), and each file holds its part's figures."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks/gpu_check.sh")
PARTS = ("machine", "tests", "decode", "memory", "train", "async", "async: the synchronous loop")


def check(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    # PYTHON: the script's interpreter is this one, whatever `python3` is on PATH
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})


def test_smoke_check_runs_every_part_and_brings_back_at_most_eight_files(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    result = check("--smoke", "--out", str(out), "--runs", str(runs))
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.txt").read_text()
    for name in PARTS:
        assert f"\n{name}: ok" in summary or f"\n{name}: written" in summary, summary
    assert "gpu_check: done" in summary
    files = sorted(p.name for p in out.iterdir())
    assert files == ["async.txt", "decode.txt", "machine.txt", "memory.txt", "summary.txt", "tests.txt", "train.txt"]
    tests = (out / "tests.txt").read_text()
    assert " passed" in tests and "failed" not in tests, tests
    decode = (out / "decode.txt").read_text()
    assert "tok/s" in decode and "1st call-median" in decode
    memory = (out / "memory.txt").read_text()
    for phase in ("| off | eval | 0 |", "| off | update | 2 |", "| on | generation | 2 |"):
        assert phase in memory, memory
    train = (out / "train.txt").read_text()
    assert "2 training steps" in train and "last eval: step 2" in train
    async_ = (out / "async.txt").read_text()
    assert f"run {runs}/async: 3 training steps" in async_ and f"run {runs}/sync: 3 training steps" in async_, async_


def test_a_part_out_of_time_is_recorded_and_the_next_runs(tmp_path):
    out = tmp_path / "out"
    # --scale 0.005: the memory part's limit becomes 1 s (smoke doubles it), far less than it needs
    result = check("--smoke", "--out", str(out), "--runs", str(tmp_path / "runs"), "--scale", "0.005",
                   "--parts", "nonsense memory machine")
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.txt").read_text()
    assert "unknown part nonsense" in summary and "memory: TIMED OUT at 1s" in summary, summary
    assert "machine: written" in summary and "gpu_check: done" in summary
    bad = check("--bogus", timeout=60)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


def test_the_update_part_runs_when_named(tmp_path):
    out = tmp_path / "out"
    result = check("--smoke", "--out", str(out), "--runs", str(tmp_path / "runs"), "--parts", "update")
    assert result.returncode == 0, result.stderr
    assert "\nupdate: ok" in (out / "summary.txt").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["summary.txt", "update.txt"]
