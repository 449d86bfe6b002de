"""Config loading: YAML + dotted overrides, typed coercion, errors naming the key; the generated reference is current."""

import json
import re
from pathlib import Path

import pytest

from podsrl.config import config_reference_markdown, load_config
from podsrl.errors import ConfigError
from tests.preset_configs import FIXTURE as PRESET_FIXTURE
from tests.preset_configs import resolved_presets

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_win_over_the_file_and_are_typed():
    cfg = load_config(ROOT / "configs/pods.yaml", ["rollout.n=32", "optim.lr=3e-4", "pods.m=8",
                                                    "model.lora_target_modules=[q_proj, v_proj]"])
    assert (cfg.method, cfg.rollout.n, cfg.pods.m, cfg.optim.lr) == ("pods", 32, 8, 3e-4)
    assert cfg.model.lora_target_modules == ["q_proj", "v_proj"]
    assert cfg.name == "pods"


@pytest.mark.parametrize("override, key", [
    ("rollout.nn=3", "rollout.nn"),
    ("rollout.n=abc", "rollout.n"),
    ("pods.rule=best", "pods.rule"),
    ("method=ppo", "method"),
    ("optim.lr=-1", "optim.lr"),
    ("log.progress=maybe", "log.progress"),
    ("task.name=dataset", "warmup.steps"),  # the built-in model's warm-up has no reference completions there
    ("task.name=trl_environment", "warmup.steps"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_every_preset_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


def test_docs_config_reference_is_current():
    assert (ROOT / "docs/config.md").read_text() == config_reference_markdown(), (
        "docs/config.md is stale: regenerate it with the command at its top")


@pytest.mark.parametrize("key", ["update.reuse_sampling_forward", "update.sampling_forward_max_mb"])
def test_keys_of_the_removed_sampling_forward_reuse_name_the_removal(key, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(key) + r": removed \(.*\)$"):
        load_config(None, [f"{key}=false"])
    section, name = key.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {name}: 1\n")
    with pytest.raises(ConfigError, match=r"removed \("):
        load_config(tmp_path / "c.yaml")
def test_every_preset_resolves_to_its_recorded_config():
    """Moving config code (e.g. a method's section into its module) must leave every preset's resolved keys and
    values as recorded in tests/fixtures/preset_configs.json (re-record only for a deliberate change)."""
    recorded = json.loads(PRESET_FIXTURE.read_text())
    resolved = resolved_presets()
    assert sorted(resolved) == sorted(recorded)
    for name, values in recorded.items():
        assert resolved[name] == values, name
