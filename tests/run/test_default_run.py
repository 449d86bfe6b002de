"""The default run ends by its step schedule on any machine: the wall-clock guard warns, it never truncates."""

import logging
from pathlib import Path

import yaml

from podsrl.config import load_config
from podsrl.reporting.tracking import read_metrics
from podsrl.run.trainer import Trainer
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2] / "podsrl"


def test_default_preset_has_no_wall_clock_stop():
    raw = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    assert "max_seconds" not in raw["train"] and raw["train"]["warn_seconds"] > 0
    cfg = load_config(ROOT / "configs/default.yaml")
    assert cfg.train.max_seconds == 0 and cfg.train.max_steps == 220


def test_slow_run_is_warned_and_runs_every_step(tmp_path, warmup_cache, caplog):
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{"train.max_steps": 3, "train.warn_seconds": 1e-6})
    with caplog.at_level(logging.WARNING, logger="podsrl"):
        summary = Trainer(load_config(ROOT / "configs/grpo.yaml", overrides + ["train.max_seconds=0"])).train()
    assert summary["step"] == 3
    # the built-in model is sampled by the fast engine's own loop, never by a fallback
    assert summary["engine"] == "fast" and summary["engine/fallback"] is None
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward" in r] == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if "train.warn_seconds" in r.getMessage()]
    assert len(warnings) == 1 and "continues to max_steps" in warnings[0]


def test_cpu_clock_counts_process_time_not_wall_time(tmp_path, warmup_cache, monkeypatch):
    """train.clock=cpu: time/elapsed and max_seconds follow the process's CPU time, so a stalled (descheduled)
    process does not spend its budget; here every step costs exactly 1.5 CPU seconds."""
    import podsrl.run.trainer as trainer_module

    ticks = iter(range(0, 10_000))
    fake_time = type("FakeTime", (), {"perf_counter": staticmethod(trainer_module.time.perf_counter),
                                      "process_time": staticmethod(lambda: 1.5 * next(ticks))})
    monkeypatch.setattr(trainer_module, "time", fake_time)
    overrides = tiny_overrides(tmp_path / "run", warmup_cache, **{"train.max_steps": 50, "train.eval_every": 100})
    summary = Trainer(load_config(ROOT / "configs/grpo.yaml",
                                  overrides + ["train.clock=cpu", "train.max_seconds=4"])).train()
    assert summary["step"] == 3  # 1.5, 3.0, 4.5 >= 4: stops after the third step whatever the wall-clock
    elapsed = [r["time/elapsed"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward" in r]
    assert elapsed == [1.5, 3.0, 4.5]
