"""The update and memory benchmarks run end to end at tiny sizes on the CPU, so an interface they call (the updater,
the data-parallel builder, the memory plan) cannot change under them unnoticed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "memory_plan_check": ["--models", "0", "--lengths", "8", "--rounds", "1"],
    "update_memory": ["--device", "cpu", "--repeats", "1", "--prompts", "1", "--length", "8", "--layers", "1",
                      "--width", "32"],
    "update_speed": ["--device", "cpu", "--repeats", "1", "--workload", "default", "--skip-memory"],
    "update_ops": ["--hidden", "16", "--repeats", "1"],
    "scale": ["--hidden", "32", "--layers", "1", "--prompts", "2", "--n", "2", "--max-new-tokens", "4",
              "--update-rows", "4", "--micro", "2", "--repeats", "1", "--skip-ray"],
    "episode_continuation": ["--episodes", "2", "--turns", "2", "--max-new-tokens", "4", "--answer-tokens", "4",
                             "--repeats", "1", "--hidden", "32", "--layers", "1"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_benchmark_runs_at_tiny_sizes(name):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *CASES[name]],
                            capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "load average" in result.stdout
