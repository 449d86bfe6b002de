"""The learner's state in a checkpoint, beside the weights: the optimiser and schedule, the learner's position
(step, training clock, dropped batches), the random streams, the compute accounting, the health monitor's memory,
the producer's own state (BatchProducer.state_dict) and train.async's in-flight batches. Trainer.save writes it;
a resume loads it back into the run's parts (podsrl/run/assembly.py) before the first step."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from podsrl.distributed import DistContext
from podsrl.errors import UserError
from podsrl.run.assembly import RunParts
from podsrl.run.async_generation import BackgroundGenerator
from podsrl.run.checkpoint import (
    in_flight_on_resume,
    load_checkpoint_files,
    load_generator,
    load_sharded_tensors,
    python_random_state,
    save_checkpoint,
    set_python_random_state,
)
from podsrl.run.description import world_size_change
from podsrl.run.health import HealthMonitor
from podsrl.run.producer import ProducedBatch

log = logging.getLogger("podsrl")


@dataclass(frozen=True)
class Position:
    """Where the learner stands: steps taken, the training clock, in-flight batches dropped as too stale
    (train.async: a resume with a lower bound)."""
    step: int = 0
    elapsed: float = 0.0
    dropped_batches: int = 0


@dataclass(frozen=True)
class Restored:
    """A checkpoint's learner state, loaded: its position, its in-flight batches (train.async, oldest first) and the
    weights of the batch a stop abandoned (None: none)."""
    position: Position
    in_flight: list[ProducedBatch]
    generator_start: dict | None


def save_learner(parts: RunParts, run_dir: Path, position: Position, health: HealthMonitor, dist: DistContext,
                 keep: int, generator: BackgroundGenerator | None) -> None:
    """Writes the step's checkpoint (every rank under FSDP2, the main rank otherwise)."""
    if not dist.is_main and not parts.sharded:  # every rank holds the same state (FSDP2: its own shards)
        return
    # train.async: the producer as of the batches the generator has produced (quiet until the next publish)
    in_flight = [b.state_dict() for b in generator.quiesce()] if generator is not None else None
    abandoned = None if generator is None else generator.abandoned(
        [n for n, p in parts.generation_model.named_parameters() if p.requires_grad])
    producer = parts.producer.state_dict()
    rng_state = {"trainer": producer.pop("rng"), "torch": torch.get_rng_state()}
    if parts.update_rng is not parts.producer.rng:
        rng_state["learner"] = parts.update_rng.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # a CPU run never starts CUDA
        rng_state["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "step": position.step, "elapsed": position.elapsed, **producer,
        "accounting": parts.accountant.state_dict(), "nonfinite_in_a_row": parts.updater.nonfinite_in_a_row,
        "python_random": python_random_state(), "health": health.state_dict(),
        "dropped_batches": position.dropped_batches, "world_size": dist.world_size,
    }
    optimizer_state = {"scheduler": parts.scheduler.state_dict()}
    tensors = None
    if parts.sharded:
        tensors, optimizer_state["param_groups"] = parts.data_parallel.checkpoint_state(parts.optimizer)
    else:
        optimizer_state["optimizer"] = parts.optimizer.state_dict()
    save_checkpoint(run_dir, position.step, parts.generation_model, parts.tokenizer, optimizer_state, rng_state,
                    state, keep=keep, sharded_tensors=tensors, dist_ctx=dist if parts.sharded else None,
                    in_flight=in_flight, generator=abandoned)


def restore_learner(parts: RunParts, health: HealthMonitor, dist: DistContext, asynchronous: bool) -> Restored:
    """Loads the checkpoint `parts` resume from into the learner and the producer."""
    path = parts.checkpoint
    optimizer_state, rng_state, state = load_checkpoint_files(path)
    _restore_optimizer(parts, path, optimizer_state)
    parts.producer.load_state_dict({**state, "rng": rng_state["trainer"]})
    if "learner" in rng_state and parts.update_rng is not parts.producer.rng:  # else: its own stream starts
        parts.update_rng.set_state(rng_state["learner"])
    torch.set_rng_state(rng_state["torch"])
    parts.accountant.load_state_dict(state["accounting"])
    parts.updater.nonfinite_in_a_row = state["nonfinite_in_a_row"]
    set_python_random_state(state["python_random"])
    health.load_state_dict(state.get("health", {}))
    if "cuda" in rng_state and torch.cuda.is_available() and len(rng_state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng_state["cuda"])
    written = state.get("world_size")  # absent from checkpoints of older versions: not known, nothing said
    if written is not None and written != dist.world_size and dist.is_main:  # one line for the job
        log.warning(world_size_change(written, dist.world_size))
    saved = in_flight_on_resume(path, asynchronous, state["step"])
    return Restored(position=Position(state["step"], state["elapsed"], state.get("dropped_batches", 0)),
                    in_flight=[ProducedBatch.from_state(b) for b in saved], generator_start=load_generator(path))


def _restore_optimizer(parts: RunParts, path: Path, optimizer_state: dict) -> None:
    """The optimiser's and the schedule's state, as the checkpoint was written: whole, or FSDP2's shards."""
    if parts.sharded != ("param_groups" in optimizer_state):
        written = "train.strategy=fsdp under torchrun" if "param_groups" in optimizer_state else \
            "train.strategy=ddp or one process"
        raise UserError(f"checkpoint {path} was written with {written}; resume it the same way")
    if parts.sharded:  # model/ holds the generation copy (compute dtype); the exact shards are in sharded/
        tensors, _ = parts.data_parallel.checkpoint_state(parts.optimizer)
        load_sharded_tensors(tensors, path / "sharded")
        parts.data_parallel.load_checkpoint_state(parts.optimizer, tensors, optimizer_state["param_groups"])
    else:
        parts.optimizer.load_state_dict(optimizer_state["optimizer"])
    parts.scheduler.load_state_dict(optimizer_state["scheduler"])
