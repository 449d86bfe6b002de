"""What a checkpoint holds of a run besides its weights (positions, clocks, RNG streams, optimiser, per-prompt
history, method and health state, train.async's in-flight batches) and how a resume puts it back, so that a resumed
run continues exactly."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from podsrl.async_generation import ProducedBatch
from podsrl.checkpoint import load_checkpoint_files, load_in_flight, load_sharded_tensors, save_checkpoint
from podsrl.errors import UserError
from podsrl.run_description import world_size_change

if TYPE_CHECKING:
    from podsrl.trainer import Trainer


log = logging.getLogger("podsrl")


def save_run(trainer: Trainer) -> None:
    """Writes the step's checkpoint (every rank under FSDP2, the main rank otherwise)."""
    t = trainer
    sharded = t.data_parallel is not None and t.data_parallel.sharded
    if not t.dist.is_main and not sharded:  # every rank holds the same state (FSDP2: its own shards)
        return
    # train.async: the generator's side (position, RNG, statistics, method) as of the batches it has produced
    in_flight = [b.state_dict() for b in t.generator.quiesce()] if t.generator is not None else None
    state = {
        "step": t.step, "data_position": t.data_position, "elapsed": t.elapsed,
        "prompt_stats": t.stats.state_dict(), "accounting": t.accountant.state_dict(),
        "nonfinite_in_a_row": t.updater.nonfinite_in_a_row, "python_random": _py_random_state(),
        "method": t.method.state_dict(), "health": t.health.state_dict(), "dropped_batches": t.dropped_batches,
        "world_size": t.dist.world_size,
    }
    optimizer_state = {"scheduler": t.scheduler.state_dict()}
    tensors = None
    if sharded:
        tensors, optimizer_state["param_groups"] = t.data_parallel.checkpoint_state(t.optimizer)
    else:
        optimizer_state["optimizer"] = t.optimizer.state_dict()
    rng_state = {"trainer": t.rng.get_state(), "torch": torch.get_rng_state()}
    if t.update_rng is not t.rng:
        rng_state["learner"] = t.update_rng.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # a CPU run never starts CUDA
        rng_state["cuda"] = torch.cuda.get_rng_state_all()
    save_checkpoint(t.run_dir, t.step, t.generation_model, t.tokenizer, optimizer_state, rng_state, state,
                    keep=t.cfg.train.keep_checkpoints, sharded_tensors=tensors, dist_ctx=t.dist if sharded else None,
                    in_flight=in_flight)


def restore_run(trainer: Trainer, path: Path) -> list[ProducedBatch]:
    """Loads the checkpoint's state into the trainer; returns its in-flight batches (train.async), oldest first."""
    t = trainer
    optimizer_state, rng_state, state = load_checkpoint_files(path)
    sharded = t.data_parallel is not None and t.data_parallel.sharded
    if sharded != ("param_groups" in optimizer_state):
        written = "train.strategy=fsdp under torchrun" if "param_groups" in optimizer_state else \
            "train.strategy=ddp or one process"
        raise UserError(f"checkpoint {path} was written with {written}; resume it the same way")
    if sharded:  # model/ holds the generation copy (compute dtype); the exact shards are in sharded/
        tensors, _ = t.data_parallel.checkpoint_state(t.optimizer)
        load_sharded_tensors(tensors, path / "sharded")
        t.data_parallel.load_checkpoint_state(t.optimizer, tensors, optimizer_state["param_groups"])
    else:
        t.optimizer.load_state_dict(optimizer_state["optimizer"])
    t.scheduler.load_state_dict(optimizer_state["scheduler"])
    t.rng.set_state(rng_state["trainer"])
    if "learner" in rng_state and t.update_rng is not t.rng:  # else: the learner starts its own stream
        t.update_rng.set_state(rng_state["learner"])
    torch.set_rng_state(rng_state["torch"])
    t.step, t.data_position, t.elapsed = state["step"], state["data_position"], state["elapsed"]
    t.stats.load_state_dict(state["prompt_stats"])
    t.accountant.load_state_dict(state["accounting"])
    t.updater.nonfinite_in_a_row = state["nonfinite_in_a_row"]
    _set_py_random_state(state["python_random"])
    t.method.load_state_dict(state.get("method", {}))
    t.health.load_state_dict(state.get("health", {}))
    if "cuda" in rng_state and torch.cuda.is_available() and len(rng_state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng_state["cuda"])
    t.dropped_batches = state.get("dropped_batches", 0)
    written = state.get("world_size")  # absent from checkpoints of older versions: not known, nothing said
    if written is not None and written != t.dist.world_size and t.dist.is_main:  # one line for the job
        log.warning(world_size_change(written, t.dist.world_size))
    saved = load_in_flight(path)
    if saved and not t.cfg.train.asynchronous.enabled:
        raise UserError(f"checkpoint {path} holds {len(saved)} batches generated ahead by an asynchronous run "
                        "(train.async.enabled=true); resume it with train.async.enabled=true")
    return [ProducedBatch.from_state(b) for b in saved]


def _py_random_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _set_py_random_state(state: list) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))
