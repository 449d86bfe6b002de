"""examples/trl_pods.py holds out a seeded eval set and evaluates it with TRL's own evaluation; without one it
trains and says so."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkout import pythonpath

pytest.importorskip("trl")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fraction", ["0.05", "0"])
def test_trl_example_with_and_without_eval_set(tmp_path, fraction):
    env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "examples/trl_pods.py"), "--steps", "2", "--eval-fraction",
                           fraction, "--output-dir", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if fraction == "0":
        assert "no eval set (--eval-fraction 0): training without evaluation" in done.stdout
        assert "held-out reward" not in done.stdout
    else:
        assert "held out 26 of 512 prompts for evaluation" in done.stdout
        assert "step   2: held-out reward" in done.stdout
