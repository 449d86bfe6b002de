"""The TRL migration table (docs/trl.md, generated from podsrl/config/trl_names.py) against the installed TRL: every
GRPOConfig field it names exists with the default it states, every podsrl key exists, the doc is current; and a
podsrl config takes TRL's names where the meaning is the same."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from podsrl.cli import main
from podsrl.config import config_help, load_config
from podsrl.config.trl_names import ACCEPTED, ROWS
from podsrl.config.trl_table import ENGINE_OPTION, trl_table_markdown
from podsrl.engines import engine_options
from podsrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_every_row_matches_the_installed_grpo_config():
    trl = pytest.importorskip("trl")
    fields = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    for row in ROWS:
        assert row.trl in fields, f"TRL {trl.__version__} has no GRPOConfig.{row.trl}: drop or rename its row"
        f = fields[row.trl]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert default == row.trl_default and type(default) is type(row.trl_default), (
            f"GRPOConfig.{row.trl} defaults to {default!r} in TRL {trl.__version__}; the table says "
            f"{row.trl_default!r}")


def test_every_podsrl_key_exists_and_the_doc_is_current():
    keys = {key for key, _, _ in config_help()} | {ENGINE_OPTION + option for option in engine_options("vllm")}
    for row in ROWS:
        assert set(row.podsrl) | set(row.fills) <= keys, row
    assert trl_table_markdown() in (ROOT / "docs/trl.md").read_text(encoding="utf-8"), (
        "docs/trl.md's table is stale: regenerate it with the command above it")


def test_trl_names_configure_what_podsrl_keys_do():
    trl = load_config(None, ["learning_rate=1e-6", "num_generations=8", "max_completion_length=512",
                             "loss_type=dr_grpo", "scale_rewards=false", "num_iterations=2", "epsilon=0.3",
                             "lr_scheduler_type=cosine", "report_to=none", "eval_steps=5"])
    ours = load_config(None, ["optim.lr=1e-6", "rollout.n=8", "rollout.max_new_tokens=512",
                              "algo.loss_agg=seq_mean_token_sum_norm", "algo.scale=none", "optim.epochs=2",
                              "algo.epsilon_low=0.3", "algo.epsilon_high=0.3", "optim.scheduler=cosine",
                              "log.report_to=none", "train.eval_every=5"])
    assert trl == ours
    both = load_config(None, ["epsilon=0.2", "epsilon_high=0.28"])  # DAPO's clip-higher, written TRL's way
    assert (both.algo.epsilon_low, both.algo.epsilon_high) == (0.2, 0.28)
    assert {"learning_rate", "num_generations", "max_completion_length", "beta", "num_iterations"} <= set(ACCEPTED)


@pytest.mark.parametrize("overrides,message", [
    (["num_generations=8", "rollout.n=16"], r"^num_generations: TRL's name for rollout\.n, which is also set"),
    (["loss_type=bnpo"], r"^loss_type: 'bnpo' has no podsrl counterpart; use one of dapo, grpo, dr_grpo"),
    (["lr_scheduler_type=linear"], r"^lr_scheduler_type: 'linear' has no podsrl counterpart"),
    (["per_device_train_batch_size=8"], r"^per_device_train_batch_size: TRL's name, not taken by podsrl since the "
                                        r"meaning differs; set rollout\.prompts_per_step"),
    (["bf16=auto"], r"^bf16: 'auto' has no podsrl counterpart; use one of None, True, False"),
    (["vllm_mode=server"], r"^vllm_mode: 'server' has no podsrl counterpart; use one of colocate \(or set "
                           r"rollout\.engine=vllm, which runs vLLM colocated with the trainer\)"),
    (["vllm_gpu_memory_utilization=0.5"], r"^rollout\.engine_options\.gpu_memory_utilization: not an option of the "
                                          r"'fast' engine"),
    (["gradient_checkpointing=true", "update.activation_checkpointing=false"],
     r"^gradient_checkpointing: TRL's name for update\.activation_checkpointing, which is also set"),
])
def test_trl_names_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_trl_names_on_the_command_line_override_the_preset(capsys):
    """The command line of README.md and docs/trl.md: the preset sets rollout.n, optim.lr and algo.loss_agg; the TRL
    names given after it win."""
    preset = load_config(ROOT / "podsrl/configs/grpo.yaml")
    assert (preset.rollout.n, preset.optim.lr, preset.algo.loss_agg) != (8, 1e-6, "seq_mean_token_mean")
    code = main(["train", "--config", "grpo", "num_generations=8", "learning_rate=1e-6", "loss_type=grpo",
                 "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert code == 0
    assert (printed["rollout"]["n"], printed["optim"]["lr"], printed["algo"]["loss_agg"]) == (
        8, 1e-6, "seq_mean_token_mean")


def test_a_trl_name_and_its_key_in_one_file_conflict(tmp_path):
    config = tmp_path / "both.yaml"
    config.write_text("num_generations: 8\nrollout: {n: 16}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^num_generations: TRL's name for rollout\.n, which is also set"):
        load_config(config)


def test_trl_vllm_names_configure_the_vllm_engine():
    cfg = load_config(None, ["use_vllm=true", "vllm_mode=colocate", "vllm_gpu_memory_utilization=0.3"])
    assert (cfg.rollout.engine, cfg.rollout.engine_options) == ("vllm", {"gpu_memory_utilization": 0.3})
    assert load_config(None, ["use_vllm=false"]).rollout.engine == "hf"
