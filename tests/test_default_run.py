"""The default run ends by its step schedule on any machine: the wall-clock guard warns, it never truncates."""

import logging
from pathlib import Path

import yaml

from podsrl.config import load_config
from podsrl.tracking import read_metrics
from podsrl.trainer import Trainer
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1] / "podsrl"


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
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward" in r] == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if "train.warn_seconds" in r.getMessage()]
    assert len(warnings) == 1 and "continues to max_steps" in warnings[0]
