"""optim.micro_batch_size=auto (0): decided once at start-up as the largest micro-batch the memory plan fits on the
run's CUDA device, at most a rank's mini-batch (the CPU: 256 rows, the default's); one log line says the size and
why. The size changes no gradients, and a token budget (optim.micro_batch_tokens) still cuts within it."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from podsrl.algo.micro_batches import row_tokens
from podsrl.cli import main
from podsrl.config import load_config, to_dict
from podsrl.errors import UserError
from podsrl.memory_plan import (
    AUTO_MICRO_BATCH_CPU,
    auto_micro_batch,
    transformers_config,
    workload_from_config,
)
from podsrl.models.loading import build_char_tokenizer
from podsrl.planning.memory import GIB, RESERVE, largest_micro_batch, with_rows_in_flight
from podsrl.planning.workload import model_shape
from podsrl.run import micro_batch
from podsrl.run.micro_batch import resolve_micro_batch
from podsrl.tasks import build_task
from podsrl.update import UpdateSettings
from tests.update.test_micro_batch_tokens import count_micro_steps
from tests.update.test_shared_prompt import grads, hf_model, make_batch, make_updater, rel

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5  # the project's float32 path-equality bound: the same sums in other micro-batches, reordered
SIZES = [4, 1, 3, 2, 5]  # the batch's groups: 15 rows, what 5 prompts x rollout.n=3 train under GRPO
RUN = ["rollout.prompts_per_step=5", "rollout.n=3", "task.max_prompt_length=9"]
make = functools.partial(hf_model, "qwen2", vocab=300, hidden=64, layers=2)


def test_auto_is_zero_and_a_negative_size_is_refused():
    assert load_config(None, ["optim.micro_batch_size=auto"]).optim.micro_batch_size == 0
    assert load_config(None, ["optim.micro_batch_size=0"]).optim.micro_batch_size == 0
    with pytest.raises(UserError, match="optim.micro_batch_size"):
        load_config(None, ["optim.micro_batch_size=-1"])


def test_the_updater_refuses_an_undecided_size():
    with pytest.raises(ValueError, match="resolve_micro_batch"):
        make_updater(make(), True, "optim.micro_batch_size=0")


def plan_rows(cfg, model, memory: int) -> int:
    """`podsrl plan --memory`'s largest micro-batch (make_plan's, at update.activation_checkpointing)."""
    shape = model_shape(model.config, 0, cfg.model.lora_target_modules)
    budget = int(memory * (1 - RESERVE))
    work = with_rows_in_flight(shape, workload_from_config(cfg, 9, "cuda", 1), budget)
    return largest_micro_batch(shape, replace(work, kept_decode_state=False), budget,
                               cfg.update.activation_checkpointing)


def test_cuda_takes_the_plans_largest_capped_at_the_mini_batch():
    model = make()
    cfg = load_config(None, [*RUN, "optim.micro_batch_size=auto"])
    rows, why = auto_micro_batch(cfg, model.config, 9, "cuda", 1, 80 * GIB)
    assert rows == 15 and "one micro-batch" in why  # the plan fits all 15 trained rows
    halves = load_config(None, [*RUN, "optim.micro_batch_size=auto", "optim.mini_batches=2"])
    assert auto_micro_batch(halves, model.config, 9, "cuda", 1, 80 * GIB)[0] == 8  # a mini-batch: ceil(15 / 2)
    # a device the update does not fit at 15 rows: the plan's largest micro-batch, as `podsrl plan --memory` says
    lo, hi = 2**16, 80 * GIB  # bisect for a device where the plan fits some rows but not all
    while not 0 < plan_rows(cfg, model, memory := (lo + hi) // 2) < 15:
        lo, hi = (memory, hi) if plan_rows(cfg, model, memory) == 0 else (lo, memory)
    rows, why = auto_micro_batch(cfg, model.config, 9, "cuda", 1, memory)
    assert rows == plan_rows(cfg, model, memory) and "largest micro-batch" in why
    rows, why = auto_micro_batch(cfg, model.config, 9, "cuda", 1, 2**16)
    assert rows == 1 and "not even one row" in why


def test_cpu_falls_back_to_the_stated_rows_and_says_so(caplog):
    cfg = load_config(None, [*RUN, "optim.micro_batch_size=auto"])
    with caplog.at_level(logging.INFO, logger="podsrl"):
        resolved = resolve_micro_batch(cfg, make(), None, None, torch.device("cpu"), 1, speak=True)
    assert resolved == AUTO_MICRO_BATCH_CPU == 256
    assert cfg.optim.micro_batch_size == 0  # the loaded config is not changed
    lines = [r.getMessage() for r in caplog.records if "optim.micro_batch_size=auto" in r.getMessage()]
    assert len(lines) == 1 and "256 rows" in lines[0] and "no device memory" in lines[0], lines
    set_cfg = load_config(None, [*RUN, "optim.micro_batch_size=4"])
    assert resolve_micro_batch(set_cfg, make(), None, None, torch.device("cpu"), 1, speak=True) == 4


@pytest.mark.parametrize("tokens", [False, True], ids=["rows", "token_budget"])
def test_auto_gives_the_gradients_of_small_micro_batches(tokens, monkeypatch):
    """auto on a CUDA device the plan fits whole (memory read as 80 GiB): one micro-batch of 15 rows, or with a token
    budget cuts of it; the same gradients and metrics as micro-batches of 4 rows, the update run here."""
    monkeypatch.setattr(micro_batch, "device_memory", lambda device: 80 * GIB)
    batch = make_batch(SIZES, 300, seed=2, max_len=12)
    lengths = row_tokens(batch.prompt_mask, batch.completion_mask)
    budget = [f"optim.micro_batch_tokens={int(lengths.max()) + 6}"] if tokens else []
    cfg = load_config(None, [*RUN, "optim.micro_batch_size=auto", *budget])
    rows = resolve_micro_batch(cfg, make(), None, None, torch.device("cuda"), 1, speak=False)
    assert rows == 15
    out = []
    for overrides in (["optim.micro_batch_size=4"], [f"optim.micro_batch_size={rows}", *budget]):
        model = make()
        updater = make_updater(model, True, *RUN, *overrides)
        seen = count_micro_steps(updater)
        metrics = updater.update(batch, torch.Generator().manual_seed(5))
        out.append((metrics, grads(model), seen))
    (m0, g0, small), (m1, g1, cuts) = out
    assert len(small) == 4
    if tokens:  # the budget cuts within the auto size
        assert len(cuts) > 1 and all(lengths[c].sum() <= int(lengths.max()) + 6 for c in cuts)
    else:
        assert len(cuts) == 1
    assert rel(g1, g0) <= TOL, rel(g1, g0)
    for k in m0:
        assert abs(m1[k] - m0[k]) <= TOL * max(1.0, abs(m0[k])), (k, m1[k], m0[k])


STUDY = Path(__file__).parents[2] / "configs" / "gpu_pods_study.yaml"


def study_run(*overrides: str):
    """configs/gpu_pods_study.yaml's config, its model's shape (on the meta device) and its task, as a run has them."""
    cfg = load_config(STUDY, list(overrides))
    tokenizer = build_char_tokenizer()
    return cfg, SimpleNamespace(config=transformers_config(cfg, "tiny")), build_task(cfg.task, tokenizer), tokenizer


def test_the_default_is_auto_one_micro_batch_of_the_study_on_cuda_and_256_rows_on_the_cpu(monkeypatch):
    """The default config decides its size at start-up: on a (faked) H200 the plan fits the study's whole step of 512
    trained rows, so one micro-batch; on the CPU the 256 rows of the default before auto, the update's settings as
    an explicit 256 gives them (so every CPU run keeps its bits)."""
    assert load_config(None).optim.micro_batch_size == 0
    cfg, model, task, tokenizer = study_run()
    assert cfg.optim.micro_batch_size == 0
    monkeypatch.setattr(micro_batch, "device_memory", lambda device: int(139 * GIB))
    cuda = resolve_micro_batch(cfg, model, task, tokenizer, torch.device("cuda"), 1, speak=False)
    trained = cfg.rollout.prompts_per_step * cfg.pods.m
    assert cuda == trained == 512
    cpu = resolve_micro_batch(cfg, model, task, tokenizer, torch.device("cpu"), 1, speak=False)
    explicit = study_run("optim.micro_batch_size=256")[0]
    assert cpu == 256 and to_dict(replace(cfg, optim=explicit.optim)) == to_dict(explicit)
    assert UpdateSettings.of(cfg, micro_batch_size=cpu) == replace(UpdateSettings.of(explicit), optim=cfg.optim)


def test_plan_memory_says_what_the_configs_micro_batch_is_on_the_device(capsys):
    """`podsrl plan --memory` prints the size a run of the config would take: auto's decision, or the set size."""
    args = ["plan", str(STUDY), "--memory", "--gpu-memory", "139GiB"]
    assert main(args) == 0
    assert ("this config: optim.micro_batch_size=auto -> 512 rows per micro-batch on each rank at start-up: the "
            "memory plan fits a rank's whole mini-batch (512 rows)") in capsys.readouterr().out
    assert main([*args, "--device", "cpu"]) == 0
    assert "optim.micro_batch_size=auto -> 256 rows" in capsys.readouterr().out
    assert main([*args, "optim.micro_batch_size=64"]) == 0
    assert "this config: optim.micro_batch_size=64 (set)" in capsys.readouterr().out
