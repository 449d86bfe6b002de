"""Health checks: a collapsing run (a learning rate far too high) warns once, flags `health/*` in its metrics and
lists the warning in summary.json; with train.stop_on_collapse it stops there with one line and exit code 3."""

from __future__ import annotations

import json

from podsrl.config import TrainConfig
from podsrl.exit_codes import ExitCode
from podsrl.reporting.tracking import read_metrics
from podsrl.run.checkpoint import latest_checkpoint
from podsrl.run.health import HealthMonitor
from tests.faults.common import error_line, train_argv

COLLAPSE = {"optim.lr": 100, "train.health_steps": 3}  # the tiny policy is deterministic from step 2 on
# (at lr 10 step 4's entropy sat near the 0.01 threshold, on either side as float rounding changed)
ENTROPY = "token entropy has been below train.health_min_entropy=0.01 for 3 steps"


def _steps(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "reward" in r}


def test_a_collapse_warns_once_and_is_recorded(tmp_path, launcher, warm_cache):
    run = tmp_path / "run"
    result = launcher.run(train_argv(run, warm_cache, **COLLAPSE))
    assert result.code == ExitCode.FINISHED, result.stderr[-3000:]  # a warning, not a stop
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING health:")]
    assert len(warnings) == 1 and f"step 4: {ENTROPY}" in warnings[0], result.stderr[-3000:]
    assert warnings[0].removeprefix("WARNING ") in (run / "run.log").read_text()
    steps = _steps(run)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]  # the run went on to its end
    assert [steps[s]["health/entropy_collapse"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 0.0, 1.0]
    summary = json.loads((run / "summary.json").read_text())
    assert [(w["check"], w["step"]) for w in summary["health_warnings"]] == [("entropy_collapse", 4)]
    assert summary["health_warnings"][0]["message"].startswith(ENTROPY)


def test_stop_on_collapse_stops_with_one_line(tmp_path, launcher, warm_cache):
    run = tmp_path / "run"
    result = launcher.run(train_argv(run, warm_cache, **COLLAPSE, **{"train.stop_on_collapse": True}))
    assert result.code == ExitCode.UNHEALTHY == 3, result.stderr[-3000:]
    line = error_line(result.stderr)
    assert line.startswith(f"podsrl: error: training stopped at step 4 (train.stop_on_collapse): {ENTROPY}"), line
    assert f"Try a lower optim.lr; the last checkpoint before it is in {run / 'checkpoints'}" in line
    assert max(_steps(run)) == 4 and _steps(run)[4]["health/entropy_collapse"] == 1.0  # the step that fired
    assert latest_checkpoint(run).name == "step-00000002"  # kept, as before the collapse
    assert not (run / "summary.json").exists()  # not finished: a resume continues from step 2


def test_each_check_fires_after_its_streak_and_warns_once(caplog):
    monitor = HealthMonitor(TrainConfig(health_steps=2, health_max_kl=1.0))
    healthy = {"reward": 0.5, "completions/mean_length": 20.0, "entropy": 0.8, "kl": 0.01,
               "clip_ratio/region_mean": 0.1, "train/nonfinite_skipped": 0.0}
    bad = {"reward": 0.0, "completions/mean_length": 0.0, "entropy": 0.0, "kl": 5.0,
           "clip_ratio/region_mean": 0.9, "train/nonfinite_skipped": 1.0}
    names = ["reward_zero", "empty_completions", "entropy_collapse", "kl_blowup", "ratio_blowup", "nonfinite_skips"]
    with caplog.at_level("WARNING", logger="podsrl"):
        assert set(monitor.observe(healthy, 1).values()) == {0.0}
        first = monitor.observe(bad, 2)  # a non-finite skip fires at once, the others need 2 steps in a row
        assert [first[f"health/{n}"] for n in names] == [0, 0, 0, 0, 0, 1]
        assert set(monitor.observe(bad, 3).values()) == {1.0}
        assert monitor.observe({**healthy, "reward": float("nan")}, 4)["health/reward_zero"] == 0.0
        state = monitor.state_dict()
        resumed = HealthMonitor(TrainConfig(health_steps=2, health_max_kl=1.0))
        resumed.load_state_dict(json.loads(json.dumps(state)))  # through state.json, as a checkpoint keeps it
        assert set(resumed.observe(bad, 5).values()) == {0.0, 1.0} and resumed.observe(bad, 6) == first | {
            f"health/{n}": 1.0 for n in names}
    assert len(caplog.records) == len(names)  # once per check, the resumed monitor included
    assert [(w["check"], w["step"]) for w in resumed.warnings] == [(n, 2 if n == "nonfinite_skips" else 3)
                                                                  for n in ["nonfinite_skips", *names[:-1]]]
    assert HealthMonitor(TrainConfig(health_steps=0)).observe(bad, 1) == {}
