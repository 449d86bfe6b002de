"""Config loading: YAML + dotted overrides, typed coercion, errors naming the key; the generated reference is current."""

import json
import re
from pathlib import Path

import pytest

from podsrl.config import config_reference_markdown, load_config
from podsrl.errors import ConfigError
from tests.preset_configs import FIXTURE as PRESET_FIXTURE
from tests.preset_configs import resolved_presets

ROOT = Path(__file__).resolve().parents[2]


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


def test_top_level_x_keys_are_ignored_as_a_home_for_yaml_anchors(tmp_path):
    (tmp_path / "c.yaml").write_text("x-short: &short {n: 4, max_new_tokens: 64}\n"
                                     "x-lr: &lr 0.0003\n"
                                     "rollout: {<<: *short, temperature: 0.7}\n"
                                     "optim: {lr: *lr}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.rollout.temperature) == (4, 64, 0.7)
    assert cfg.optim.lr == 0.0003
    (tmp_path / "bad.yaml").write_text("anchors: &short {n: 4}\nrollout: *short\n")
    with pytest.raises(ConfigError, match=r"^anchors: unknown config key \(a top-level key starting with 'x-' is "
                                          r"ignored: the place for YAML anchors\)$"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "typo.yaml").write_text("rollouts: {n: 4}\n")
    with pytest.raises(ConfigError, match=r"^rollouts: unknown config key \(did you mean rollout\?; a top-level key "
                                          r"starting with 'x-' is ignored"):
        load_config(tmp_path / "typo.yaml")
    with pytest.raises(ConfigError, match=r"^rollout.nn: unknown config key$"):  # below the top: no such advice
        load_config(None, ["rollout.nn=3"])
