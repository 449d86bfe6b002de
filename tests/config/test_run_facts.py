"""A loaded config is resolved once into the facts the run uses (podsrl/config/facts.py); validation only reads it;
settings that nothing in the run reads are named at start-up."""

import copy
import logging

import torch

from podsrl.config import load_config
from podsrl.config.checks import validate
from podsrl.config.facts import run_facts, unread_settings
from podsrl.methods import METHODS
from podsrl.run.trainer import Trainer
from tests.conftest import device_under_test, tiny_overrides


def test_validation_reads_the_config_and_leaves_it_as_loaded():
    cfg = load_config(None, ["train.strategy=fsdp", "model.compute_dtype=bfloat16"])
    cfg.log.report_to = "all"  # TRL's spelling, as a config built in Python may hold it
    before = copy.deepcopy(cfg)
    validate(cfg)
    assert cfg == before
    assert cfg.train.fsdp_param_dtype == "auto"  # the FSDP2 pairing is resolved, not written back
    assert run_facts(cfg, torch.device("cpu")).compute_dtype == torch.bfloat16


def test_the_facts_of_a_config():
    device = device_under_test()
    facts = run_facts(load_config(None), device)
    pods = METHODS["pods"]  # the one resolution of the rollouts per prompt the update trains
    assert pods.trained_per_prompt(load_config("podsrl/configs/pods.yaml", ["pods.m=0", "rollout.n=6"])) == 6
    assert pods.trained_per_prompt(load_config("podsrl/configs/pods.yaml", ["pods.m=4"])) == 4
    assert facts.master_dtype == torch.float32
    assert facts.compute_dtype == (torch.bfloat16 if device.type == "cuda" else torch.float32)
    assert not facts.overlap
    ahead = run_facts(load_config(None, ["train.async.enabled=true", "model.compute_dtype=float32"]), device)
    assert ahead.overlap and ahead.mismatch == ("staleness",) and ahead.rollout_correction == "sequence_mask"
    lockstep = run_facts(load_config(None, ["train.async.enabled=true", "train.async.max_staleness=0"]), device)
    assert not lockstep.overlap


def test_the_generation_copy_is_resolved_where_it_lives():
    """FSDP's copy of the policy for the engines is in the compute dtype of the device it lives on: the training
    device's by default, the CPU's (float32) for an engine whose copy lives there, whatever the training device."""
    cuda = torch.device("cuda")  # only the device's type is read: no GPU needed
    here = run_facts(load_config(None), cuda)
    assert (here.generation_device, here.generation_dtype) == (cuda, here.compute_dtype) == (cuda, torch.bfloat16)
    pool = run_facts(load_config(None, ["rollout.engine=ray"]), cuda)
    assert pool.compute_dtype == torch.bfloat16
    assert (pool.generation_device, pool.generation_dtype) == (torch.device("cpu"), torch.float32)


def test_settings_of_a_method_not_chosen_are_named_in_one_startup_warning(tmp_path, warmup_cache, caplog):
    overrides = {"pods.m": 4, "aero.k": 3, "train.max_steps": 1}
    cfg = load_config("podsrl/configs/grpo.yaml", tiny_overrides(tmp_path / "run", warmup_cache, **overrides))
    assert unread_settings(cfg) == ["pods.m", "aero.k"]
    assert unread_settings(load_config("podsrl/configs/pods.yaml", ["pods.m=4"])) == []  # the chosen one's own
    with caplog.at_level(logging.WARNING, "podsrl"):
        Trainer(cfg).train()
    said = [r.getMessage() for r in caplog.records if "nothing in this run reads" in r.getMessage()]
    assert said == ["settings nothing in this run reads (method: grpo reads only its own section): pods.m, aero.k"]
