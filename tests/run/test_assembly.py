"""The trainer's parts are assembled once (podsrl/run/assembly.py) and the config stays as loaded: optim.micro_batch_size
=auto is decided into the run's parts and the update's settings, never written into the config the run holds, logs
or saves in its directory, so a resume decides it again from the same `auto`."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from podsrl.config import load_config
from podsrl.memory_plan import AUTO_MICRO_BATCH_CPU
from podsrl.run.trainer import Trainer
from tests.conftest import device_under_test, tiny_overrides


def saved_micro_batch_size(run_dir) -> int:
    return yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))["optim"]["micro_batch_size"]


@pytest.mark.skipif(device_under_test().type != "cpu", reason="auto's CPU decision (a fixed 256 rows)")
def test_auto_micro_batch_is_a_part_of_the_run_not_of_its_config(tmp_path, warmup_cache):
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(run_dir, warmup_cache, **{"optim.micro_batch_size": "auto",
                                                                     "train.save_every": 1}))
    trainer = Trainer(cfg)
    assert trainer.cfg is cfg and trainer.cfg.optim.micro_batch_size == 0
    assert saved_micro_batch_size(run_dir) == 0  # the run directory's config.yaml: as loaded
    assert trainer.parts.micro_batch == trainer.parts.updater.cfg.micro_batch_size == AUTO_MICRO_BATCH_CPU
    trainer.train()
    assert saved_micro_batch_size(run_dir) == 0
    resumed = Trainer(load_config(run_dir / "config.yaml", [f"output_dir={run_dir}", "train.max_steps=3"]),
                      resume=True)
    try:
        assert resumed.step == 2 and resumed.cfg.optim.micro_batch_size == 0
        assert resumed.parts.updater.cfg.micro_batch_size == AUTO_MICRO_BATCH_CPU  # decided again, the same
    finally:
        resumed.close()
        resumed._release_run_dir()


def test_the_parts_are_frozen(tmp_path, warmup_cache):
    trainer = Trainer(load_config(None, tiny_overrides(tmp_path / "run", warmup_cache, **{"optim.micro_batch_size": 4})))
    try:
        assert trainer.parts.micro_batch == trainer.parts.updater.cfg.micro_batch_size == 4  # a set size as set
        with pytest.raises(dataclasses.FrozenInstanceError):
            trainer.parts.engine = None
    finally:
        trainer.close()
        trainer._release_run_dir()
