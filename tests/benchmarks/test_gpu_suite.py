"""benchmarks/gpu_suite.sh's plumbing (argument handling, the summary file) and benchmarks/run_summary.py."""

import json
import subprocess
from pathlib import Path

import torch

from benchmarks.run_summary import summary
from tests.conftest import device_under_test

ROOT = Path(__file__).resolve().parents[2]


def test_run_summary_reports_steps_clock_and_first_and_last_eval(tmp_path):
    records = [{"step": 0, "time/elapsed": 0.0, "time/eval": 0.5, "eval/accuracy": 0.125},
               {"step": 1, "reward": 0.25, "time/elapsed": 1.5, "time/step": 1.5},
               {"step": 2, "reward": 0.5, "time/elapsed": 3.0, "time/step": 1.5},
               {"step": 2, "time/elapsed": 3.0, "time/eval": 0.4, "eval/accuracy": 0.375}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[1:]))
    lines = summary(tmp_path)
    assert "2 training steps, 1 eval records" in lines[0]
    assert lines[1] == "last step 2: time/elapsed 3.0 s, reward 0.500, mean time/step 1.500 s"
    assert lines[2].startswith("last eval: step 2") and "eval/accuracy 0.375" in lines[2] and len(lines) == 3
    records[1]["sampling/importance_sampling_ratio/mean"], records[2]["sampling/importance_sampling_ratio/mean"] = 1, 0.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = summary(tmp_path)
    assert lines[2] == "sampling, mean over steps: sampling/importance_sampling_ratio/mean 0.75"
    assert lines[3].startswith("first eval: step 0") and "eval/accuracy 0.125" in lines[3]
    assert lines[4].startswith("last eval: step 2") and "eval/accuracy 0.375" in lines[4]


def test_suite_records_an_unknown_part_and_goes_on(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_suite.sh"), "--smoke", "--out", str(out),
                             "--parts", "nonsense"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    text = (out / "summary.txt").read_text()
    assert "unknown part nonsense" in text and "gpu_suite: done" in text
    bad = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_suite.sh"), "--bogus"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


def test_device_under_test_is_the_one_chosen(request):
    assert device_under_test() == torch.device(request.config.getoption("--device"))
