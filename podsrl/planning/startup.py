"""What a run holds before its first step, for `podsrl plan --memory`: the start-up peak of the rank that needs most
(rank 0) while the models load and the generation copy is made, the host memory rank 0 loads through, and the
bytes each checkpoint writes. The steps' own peaks are podsrl/planning/memory.py, which adds these to its plan.

Start-up under FSDP2 (podsrl/models/sharded_loading.py, podsrl/fsdp.py), per rank: the policy's shards, then the
reference's, arrive one tensor at a time (rank 0 holds that whole tensor in the master dtype on its device while it
scatters its rows); then the generation copy is allocated whole in the compute dtype and filled one gathered
parameter at a time (that parameter whole and its shard, both in the compute dtype). Otherwise (one process, DDP)
each rank holds the whole model as loaded, and the fast engine's copy in the compute dtype when it is narrower.
"""

from __future__ import annotations

from podsrl.planning.workload import DTYPE_BYTES, ModelShape, Workload

ADAM_STATES = 2  # exp_avg and exp_avg_sq (torch.optim.AdamW), each in its parameter's dtype


def largest_tensor(shape: ModelShape) -> tuple[int, int]:
    """(rows, columns) of the model's largest parameter: the embedding or the output head (V x D), else a projection
    (FSDP2 shards rows)."""
    return max((shape.vocab, shape.hidden), (shape.intermediate, shape.hidden),
               (shape.heads * shape.head_dim, shape.hidden), key=lambda rc: rc[0] * rc[1])


def stored_bytes(shape: ModelShape) -> int:
    """Bytes per element of the checkpoint the model is read from (its config's dtype; float32 when it names none)."""
    return DTYPE_BYTES.get(shape.stored_dtype, 4)


def streamed(shape: ModelShape, work: Workload) -> bool:
    """Rank 0 reads the checkpoint one tensor at a time (FSDP2 over ranks, no LoRA, a safetensors checkpoint); else
    it loads the whole model into host memory first."""
    return work.sharded and not shape.lora


def startup_peak(shape: ModelShape, work: Workload, resident: dict[str, int]) -> dict[str, int]:
    """Terms of rank 0's start-up peak: `resident` (the weights, reference and engine and generator copies as the
    steps' plan counts them, all there once start-up ends; no gradients or AdamW state yet: they appear at the first
    update) and the transient on top, the larger of
    - the load (FSDP2): one whole tensor in the master dtype while it is scattered (the zero-padded last piece of an
      uneven split too), and on the CPU, where host memory is the device's, the tensor as read when the checkpoint
      stores another dtype; the generation copy does not exist yet, so only what exceeds it counts;
    - the generation copy's fill (FSDP2): one gathered parameter and its shard in the compute dtype.
    One process and DDP add nothing on the device: rank 0 moves the model it loaded, the others receive in place.
    No runtime term: no kernel has run yet (on CUDA no cuBLAS workspace; the context and the communicators' buffers
    are outside the allocator, in --reserve), and on the CPU the start-up of a negligible model adds ~10 MiB
    (tests/distributed/test_startup_memory.py)."""
    transient = 0
    if work.sharded:
        (rows, columns), n = largest_tensor(shape), work.world_size
        big, piece = rows * columns, -(-rows // n) * columns
        padding = piece * work.p if rows % n else 0
        read = big * stored_bytes(shape) if work.device == "cpu" and stored_bytes(shape) != work.p else 0
        load = big * work.p + padding + read
        fill = (big + piece) * work.e
        transient = max(load - resident.get("engine_weights", 0), fill, 0)
    return {**resident, "transient": transient}


def host_load(shape: ModelShape, work: Workload) -> int:
    """Host memory rank 0 loads the model through: one tensor as stored and in the master dtype when it streams,
    else the whole model in the master dtype (the other ranks receive theirs on their device)."""
    if streamed(shape, work):
        rows, columns = largest_tensor(shape)
        return rows * columns * (stored_bytes(shape) + work.p)
    return shape.params * work.p


def checkpoint_size(export: int, weights: int, trained: int, sharded: bool) -> dict[str, int]:
    """Bytes one checkpoint writes (podsrl/run/checkpoint.py): `model/`, the exported weights (`export` bytes: the
    generation copy under FSDP2, else the policy; a LoRA adapter alone), and the training state: AdamW's two moments
    of the trained parameters (`trained` bytes), and under FSDP2 the master weights too (`weights` bytes, sharded/).
    Tokenizer, RNG, scheduler and loop state are small beside them and not counted."""
    return {"model": export, "training_state": (weights if sharded else 0) + ADAM_STATES * trained}


def planned_checkpoint(shape: ModelShape, work: Workload) -> dict[str, int]:
    """checkpoint_size of the planned run: model/ in the compute dtype under FSDP2 (its generation copy), else in
    the master dtype; LoRA's adapter (float32 trained, exported in the generation copy's dtype under FSDP2)."""
    trained = shape.trained_params * (4 if shape.lora else work.p)
    weights = (shape.params - shape.trained_params) * work.p + trained
    export_bytes = work.e if work.sharded else work.p
    export = shape.trained_params * (export_bytes if work.sharded else 4) if shape.lora else shape.params * export_bytes
    return checkpoint_size(export, weights, trained, work.sharded)


def describe_checkpoints(size: dict[str, int], keep: int, sharded: bool) -> str:
    """One line: a checkpoint's size, its parts, and the disk train.keep_checkpoints needs (one more while the
    next is written: it is renamed into place before the oldest is pruned)."""
    total = sum(size.values())
    state = "sharded/ (master weights and AdamW state)" if sharded else "optimizer.pt (AdamW state)"
    return (f"checkpoints: {_size(total)} a save (model/ {_size(size['model'])}, {state} "
            f"{_size(size['training_state'])}); train.keep_checkpoints={keep} keeps {keep}, {keep + 1} on disk while "
            f"the next is written: {_size((keep + 1) * total)}")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
