"""`podsrl compare` with the real trainer: two configs x two seeds under a tiny rollout budget, then `report`."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_two_configs_two_seeds_compare_and_report(tmp_path, warmup_cache):
    out = tmp_path / "cmp"
    overrides = [o for o in tiny_overrides(tmp_path / "unused", warmup_cache, **{"train.max_steps": 50})
                 if not o.startswith("output_dir=")]
    cmd = [sys.executable, "-m", "podsrl", "compare", str(ROOT / "configs/grpo.yaml"), str(ROOT / "configs/pods.yaml"),
           *overrides, "rollout.n=8", "pods.m=4", "--seeds", "1", "2", "--budget-rollouts", "96", "--out", str(out),
           "--no-progress"]
    # pods.yaml sets m=16 > n=8 here: the overrides go to both runs, and grpo ignores the pods section.
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for name in ("grpo", "pods"):
        for seed in (1, 2):
            assert (out / name / f"seed{seed}" / "summary.json").is_file()
    table = (out / "results.md").read_text()
    assert "grpo" in table and "pods" in table
    # Paired statistics vs the baseline: in the table, the CSV and the console.
    assert "Paired by seed against the baseline" in table and "area under acc-vs-time / T" in table
    assert "auc_verdict" in (out / "results.csv").read_text().splitlines()[0]
    assert "pods vs grpo, final acc:" in done.stderr and "(2 pairs)" in done.stderr
    assert (out / "accuracy.png").stat().st_size > 10_000
    # report rebuilds the same table from the saved runs
    rebuilt = tmp_path / "rebuilt"
    done = subprocess.run([sys.executable, "-m", "podsrl", "report", str(out), "--out", str(rebuilt)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pods vs grpo, area under acc-vs-time / T:" in done.stdout
    assert (rebuilt / "results.csv").read_text() == (out / "results.csv").read_text()
