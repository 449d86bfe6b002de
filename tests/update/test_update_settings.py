"""PolicyUpdater is handed what it reads of the config (UpdateSettings), not the config: what can change an update is
listed in podsrl/update/settings.py."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from podsrl.config import load_config
from podsrl.update import UpdateSettings

UPDATER = Path(__file__).parents[2] / "podsrl" / "update" / "updater.py"


def settings_read(source: str) -> set[str]:
    """The attributes read of `cfg` or `self.cfg` in `source` (cfg.optim.epochs -> optim)."""
    read = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "cfg") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "cfg"
                    and isinstance(owner.value, ast.Name) and owner.value.id == "self"):
                read.add(node.attr)
    return read


def test_the_updater_reads_only_its_settings():
    fields = {f.name for f in dataclasses.fields(UpdateSettings)}
    assert settings_read("x = cfg.rollout.n + self.cfg.optim.epochs\n") == {"rollout", "optim"}
    read = settings_read(UPDATER.read_text(encoding="utf-8"))
    assert {"optim", "algo", "update"} <= read and read <= fields, sorted(read - fields)


def test_the_settings_are_the_configs_values():
    cfg = load_config(None, ["rollout.temperature=0.7", "rollout.max_new_tokens=12", "log.grad_noise=true",
                             "model.lora_rank=4", "optim.epochs=2"])
    settings = UpdateSettings.of(cfg)
    assert (settings.optim, settings.update, settings.algo) == (cfg.optim, cfg.update, cfg.algo)
    assert (settings.temperature, settings.max_new_tokens, settings.grad_noise, settings.lora) == (0.7, 12, True, True)
    assert settings.unchecked_staleness is None and not UpdateSettings.of(load_config(None)).lora
    stale = UpdateSettings.of(load_config(None, ["train.async.enabled=true", "train.async.max_staleness=1",
                                                 "algo.rollout_correction=none"]))
    assert stale.unchecked_staleness.startswith("algo.rollout_correction: none with train.async.max_staleness 1")


def test_the_micro_batch_is_the_runs_decision_and_the_optim_section_as_loaded():
    auto = load_config(None, ["optim.micro_batch_size=auto"])
    decided = UpdateSettings.of(auto, micro_batch_size=256)  # what a run on the CPU decides for auto
    assert decided.micro_batch_size == 256 and decided.optim is auto.optim and auto.optim.micro_batch_size == 0
    assert UpdateSettings.of(load_config(None, ["optim.micro_batch_size=8"])).micro_batch_size == 8
