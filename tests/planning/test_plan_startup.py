"""`podsrl plan --memory` beyond the steps' peaks, and under FSDP2: the start-up row by hand (the 7B FSDP2 recipe with
a reference, DDP, the CPU's read of another stored dtype), the activations FSDP2 keeps in the compute dtype against
what the real forward saves with bfloat16 parameters (with and without activation checkpointing), and the
checkpoint size by hand and on the plan's last line. The start-up row against measured peaks on 2 gloo ranks is
tests/distributed/test_startup_memory.py."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import Qwen2Config

from podsrl.cli import main
from podsrl.planning import memory as mp
from podsrl.planning import workload as mw
from tests.planning.test_memory_plan import QWEN_1_5B, QWEN_7B, pods_work, qwen2, saved_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

def test_start_up_by_hand_for_the_7b_fsdp_recipe_with_a_reference():
    """Qwen2.5-7B, float32 masters, bfloat16 compute, FSDP2 over 8, algo.beta=0.001: rank 0 ends start-up with the
    policy's and the reference's shards and the whole bfloat16 generation copy; on top, the larger of the load's one
    float32 tensor (the [V, D] head, less than the copy it precedes) and the copy's fill (the head gathered and its
    shard in bfloat16). DDP adds nothing on top of the whole model, the reference and the engine's copy."""
    from podsrl.planning import startup

    config = Qwen2Config(**QWEN_7B, dtype="bfloat16")
    shape = mw.model_shape(config)
    assert shape.stored_dtype == "bfloat16" and startup.largest_tensor(shape) == (152064, 3584)
    fsdp = pods_work(["train.strategy=fsdp", "algo.beta=0.001"], world_size=8)
    terms = mp.startup_terms(shape, fsdp)
    shard = -(-shape.params * 4 // 8)
    head = 152064 * 3584
    assert terms == {"weights": shard, "reference": shard, "engine_weights": shape.params * 2,
                     "generator_weights": 0, "transient": (head + head // 8) * 2}
    assert sum(terms.values()) / 2**30 == pytest.approx(22.42, abs=0.01)
    assert mp.host_memory(shape, fsdp)["load"] == head * (2 + 4)  # read as bfloat16, cast to float32
    plan = mp.make_plan(shape, fsdp, 80 * 2**30)
    assert plan.fits and plan.startup == terms and plan.micro_batch[True] >= 32
    ddp = mp.startup_terms(mw.model_shape(Qwen2Config(**QWEN_1_5B)), pods_work(["algo.beta=0.001"], world_size=8))
    assert ddp["transient"] == 0 and ddp["reference"] == ddp["weights"] == 2 * ddp["engine_weights"]
    cpu = dataclasses.replace(fsdp, device="cpu")  # host memory is the device's: the head as read, in bfloat16 too
    assert startup.startup_peak(shape, cpu, {"engine_weights": 0})["transient"] == head * (4 + 2)


def test_fsdp_activations_are_counted_in_the_compute_dtype_they_are_kept_in():
    """Under FSDP2 the parameters are gathered in the compute dtype (its mixed-precision policy) and the forward runs
    in it without autocast: the saved floating-point storages of the real shared-prompt forward of a model whose
    parameters are bfloat16, as FSDP2 presents them, match the plan's count for float32 masters under FSDP2, within
    the same 1.5%, and with activation checkpointing within 2.5%, where the checkpointed residual stream (each
    layer's input) is bfloat16: half what the float32 stream of the unsharded count keeps."""
    config, prompts, m, lp, lc = qwen2(hidden=128, layers=3), 3, 5, 20, 30
    shape = mw.model_shape(config)
    work = mw.Workload(prompts, m, m, lp, lc, compute_dtype="bfloat16", device="cpu", strategy="fsdp",
                       world_size=2)
    mb = mp.MicroBatch.of(prompts * m, m, work)
    predicted = sum(mp.activations(shape, mb, work, checkpointing=False).values())
    assert predicted == pytest.approx(saved_bytes(config, prompts, m, lp, lc, weights="bfloat16"), rel=0.015)
    checkpointed = mp.activations(shape, mb, work, checkpointing=True)
    measured = saved_bytes(config, prompts, m, lp, lc, weights="bfloat16", checkpointing=True)
    assert sum(checkpointed.values()) == pytest.approx(measured, rel=0.025)
    assert checkpointed["layers"] == 3 * mb.tokens * 128 * 2  # each layer's input, in bfloat16
    unsharded = mp.activations(shape, mb, dataclasses.replace(work, world_size=1), checkpointing=True)
    assert unsharded["layers"] == 2 * checkpointed["layers"]


def test_checkpoint_size_by_hand_and_on_the_plans_last_line(tmp_path, capsys):
    """A 7B FSDP2 checkpoint: sharded/ holds the float32 masters and AdamW's two moments (12 bytes a parameter),
    model/ the bfloat16 generation copy (2 bytes): ~107 GB, printed with what keep_checkpoints needs on disk."""
    from podsrl.planning import startup

    shape = mw.model_shape(Qwen2Config(**QWEN_7B))
    size = startup.planned_checkpoint(shape, pods_work(["train.strategy=fsdp"], world_size=8))
    assert size == {"model": shape.params * 2, "training_state": shape.params * 12}
    assert sum(size.values()) / 1e9 == pytest.approx(106.6, abs=0.1)
    ddp = startup.planned_checkpoint(shape, pods_work(world_size=8))
    assert ddp == {"model": shape.params * 4, "training_state": shape.params * 8}
    lora = startup.planned_checkpoint(mw.model_shape(Qwen2Config(**QWEN_7B), 64, mw.LINEAR_MODULES), pods_work())
    assert lora["model"] < 1e9 and lora["training_state"] == 2 * lora["model"]  # the float32 adapter, its moments
    (tmp_path / "config.json").write_text(Qwen2Config(**QWEN_7B).to_json_string())
    assert main(["plan", "pods", "train.strategy=fsdp", "train.keep_checkpoints=3", "--memory", "--gpu-memory",
                 "80GiB", "--world-size", "8", "--model", str(tmp_path), "--prompt-length", "256"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == ("checkpoints: 99.3 GiB a save (model/ 14.2 GiB, sharded/ (master weights and AdamW state) "
                    "85.1 GiB); train.keep_checkpoints=3 keeps 3, 4 on disk while the next is written: 397.2 GiB")
