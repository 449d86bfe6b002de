"""Data-parallel training under `torchrun --nproc_per_node N -m podsrl train ...` (gloo on CPU, nccl on GPU).

Design: every rank runs the same loop with the same seed, so prompt order, prompt statistics, selection and the RNG
stay identical on every rank without being sent anywhere, and a checkpoint written by rank 0 resumes every rank.
- Generation is not repeated: the engine is wrapped so each rank generates a contiguous shard of each request's
  prompt groups and the shards are all-gathered; every rank then holds the same rollouts, bit for bit. With the fast
  engine (per-row seeds) they equal a one-process run's, for any number of ranks. Episodes shard by episode: each
  stays on the rank that generated its first turn, where the rank's engine continues its KV cache (ShardedSession).
- Scoring and selection run on every rank on identical inputs (cheap next to generation and the update). A
  fingerprint of the selected batch and RNG is compared before each update as a guard (a reward function with a
  timeout could disagree across ranks): on a mismatch rank 0's batch and RNG state are broadcast.
- Update: every rank holds the whole selected batch, so the token-weight totals of each mini-batch (token and
  sequence counts) are global by construction, with no collective. Each mini-batch (same permutation on every rank) is
  split into equal row shares, each rank running the same number of micro-batches on its share; gradients are summed
  (not averaged: the weights already normalise over the whole mini-batch) by one flat all-reduce per optimiser step,
  so they equal the one-process gradient. No collective runs per micro-batch, so uneven shares (down-sampling,
  uneven groups, odd row counts) cannot hang a rank; the loss and metrics are summed for logging.
- Decisions that depend on time or signals (time budget, SIGTERM) are rank 0's, broadcast.
- Rank 0 alone writes metrics, config, checkpoints and the summary; every rank evaluates (sharded as above).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import math
import os
from collections.abc import Hashable, Iterator

import torch
import torch.distributed as dist

from podsrl import waits
from podsrl.algo.micro_batches import split_rows
from podsrl.batch import RolloutBatch
from podsrl.engines.base import EpisodeSession, GenerationOutput, RolloutEngine, SamplingParams
from podsrl.engines.rows import check_request
from podsrl.engines.shards import EpisodeShards, merge_outputs, merge_rows, shard_groups

log = logging.getLogger("podsrl")


class DistContext:
    """This process's place in the job; with world_size 1 every method is a no-op."""

    def __init__(self, device: torch.device, rank: int = 0, world_size: int = 1, owns_group: bool = False,
                 cpu_group=None) -> None:
        self.device, self.rank, self.world_size = device, rank, world_size
        self.owns_group = owns_group
        self.cpu_group = cpu_group  # gloo group for CPU tensors and objects (the default group with gloo)
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. a cached warm-up), the others after it finished (cache hit)."""
        if self.enabled and not self.is_main:
            with self.collective("the barrier after rank 0's turn (main_first)"):
                dist.barrier(group=self.cpu_group)
        yield
        if self.enabled and self.is_main:
            with self.collective("the barrier after rank 0's turn (main_first)"):
                dist.barrier(group=self.cpu_group)

    def agree(self, value: bool) -> bool:
        """Rank 0's value, on every rank (for decisions taken from clocks or signals)."""
        if not self.enabled:
            return value
        t = torch.tensor([int(value)])
        with self.collective("broadcast of rank 0's decision (agree)"):
            dist.broadcast(t, src=0, group=self.cpu_group)
        return bool(t.item())

    def barrier(self) -> None:
        if self.enabled:
            with self.collective("barrier"):
                dist.barrier(group=self.cpu_group)

    def from_main(self, value):
        """Rank 0's `value` (any picklable object), on every rank."""
        if not self.enabled:
            return value
        box = [value]
        with self.collective("broadcast_object_list of rank 0's value (from_main)"):
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def wrap_engine(self, engine: RolloutEngine) -> RolloutEngine:
        return ShardedEngine(engine, self) if self.enabled else engine

    def agree_batch(self, batch: RolloutBatch, generator: torch.Generator) -> RolloutBatch:
        """The batch to update on: the ranks' own when all are identical (the normal case), else rank 0's."""
        if not self.enabled:
            return batch
        mine = batch_fingerprint(batch, generator)
        prints: list = [None] * self.world_size
        with self.collective("all_gather_object of the batch fingerprints (agree_batch)"):
            dist.all_gather_object(prints, mine, group=self.cpu_group)
        if len(set(prints)) == 1:
            return batch
        if not self._warned:
            log.warning("ranks selected different rollouts (non-deterministic rewards or generation?); "
                        "using rank 0's batch from now on when they differ")
            self._warned = True
        box = [batch, generator.get_state()] if self.is_main else [None, None]
        with self.collective("broadcast_object_list of rank 0's batch (agree_batch)"):
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        generator.set_state(box[1])
        return box[0]

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Runs collective `what`; one the other ranks do not join within the process group's timeout (set to
        train.wait_timeout_s, init_distributed) stops the run: WaitExpired naming it and this rank."""
        try:
            yield
        except RuntimeError as e:  # torch.distributed's DistBackendError is one
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise
            raise waits.WaitExpired(f"the other ranks in {what}", f"rank {self.rank} of {self.world_size}") from e

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device: torch.device, timeout_s: float | None = None) -> DistContext:
    """The context of this process: joins the torchrun job when WORLD_SIZE > 1 (or an existing process group).

    nccl when the policy is on CUDA (each rank on cuda:LOCAL_RANK), gloo otherwise. Its collectives (and the
    rendezvous) time out after `timeout_s`, by default the run's bound on waits (podsrl/waits.py).
    """
    timeout = datetime.timedelta(seconds=waits.bound() if timeout_s is None else timeout_s)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and world <= 1:
        return DistContext(device)
    owns = not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() != "gloo" else None
    if dist.get_rank() != 0:  # rank 0 speaks for the job; the others only of what goes wrong
        log.setLevel(logging.WARNING)
    return DistContext(device, dist.get_rank(), dist.get_world_size(), owns, cpu_group)


def batch_fingerprint(batch: RolloutBatch, generator: torch.Generator) -> str:
    h = hashlib.sha256()
    for t in (batch.group_index, batch.completion_ids, batch.completion_mask, batch.loss_mask, batch.advantages,
              generator.get_state()):
        if t is not None:
            t = t.detach().cpu().contiguous()
            h.update(str(tuple(t.shape)).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class ShardedEngine(RolloutEngine):
    """Each rank generates its shard of whole prompt groups; the shards are all-gathered and merged in order."""

    def __init__(self, inner: RolloutEngine, ctx: DistContext) -> None:
        self.inner, self.ctx = inner, ctx
        self.name, self.fallback_reason = inner.name, inner.fallback_reason
        self.pad_token_id = inner.pad_token_id

    def generate(self, prompts: list[list[int]], counts: list[int], params: SamplingParams,
                 seeds: torch.Tensor) -> GenerationOutput:
        rows = check_request(prompts, counts, seeds)
        if rows == 0 or params.max_new_tokens <= 0:
            return self.inner.generate(prompts, counts, params, seeds)
        shards = shard_groups(counts, self.ctx.world_size)
        s = shards[self.ctx.rank]
        local = None
        if s.rows > 0:
            local = self.inner.generate(prompts[s.start:s.end], counts[s.start:s.end], params,
                                        seeds[s.row_start:s.row_end])
        gathered: list = [None] * self.ctx.world_size
        with self.ctx.collective("all_gather_object of the generated shards"):
            dist.all_gather_object(gathered, local, group=self.ctx.cpu_group)
        parts = [(shards[r], out) for r, out in enumerate(gathered) if out is not None]
        return merge_outputs(parts, self.pad_token_id, params.return_logprobs)

    def session(self) -> EpisodeSession:
        """Where this rank's engine continues episodes' KV caches, each rank continues its own episodes'
        (ShardedSession); otherwise each turn is a sharded `generate` over the whole contexts."""
        local = self.inner.session()
        if not local.continues:
            return super().session()
        return ShardedSession(self, local)

    @property
    def sampler(self) -> str:
        return self.inner.sampler

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.inner.sync_weights(model)

    @property
    def keeps_state_across_updates(self) -> bool:
        return self.inner.keeps_state_across_updates

    def plan_rows(self, rows: int) -> None:
        self.inner.plan_rows(rows)

    def release(self) -> None:
        self.inner.release()

    def close(self) -> None:
        self.inner.close()


class ShardedSession(EpisodeSession):
    """Episodes over the ranks: every rank makes the same calls, each generates the turns of the episodes
    `EpisodeShards` gives it (an episode stays on the rank that holds its cache) in its engine's session, and the
    turns are all-gathered and put back in the call's order. A rank none of whose episodes is live closes its
    session; `close` (the runner's) and the engine's `release` close it too."""

    continues = True

    def __init__(self, engine: ShardedEngine, local: EpisodeSession) -> None:
        super().__init__(engine)
        self.local = local
        self.shards = EpisodeShards(engine.ctx.world_size)

    def generate(self, keys: list[Hashable], contexts: list[list[int]], params: SamplingParams,
                 seeds: torch.Tensor) -> GenerationOutput:
        if not contexts:
            return super().generate(keys, contexts, params, seeds)
        ctx = self.engine.ctx
        split = self.shards.split(keys)
        mine, turn = split[ctx.rank], None
        if mine:
            turn = self.local.generate([keys[r] for r in mine], [contexts[r] for r in mine], params, seeds[mine])
        else:
            self.local.close()
        gathered: list = [None] * ctx.world_size
        with ctx.collective("all_gather_object of the episode turns"):
            dist.all_gather_object(gathered, turn, group=ctx.cpu_group)
        return merge_rows(list(zip(split, gathered)), self.engine.pad_token_id, params.return_logprobs)

    def close(self) -> None:
        self.local.close()


class DataParallel:
    """What the policy updater needs from the other ranks (see the module docstring)."""

    sharded = False  # parameters whole on every rank: rank 0 alone writes checkpoints
    lockstep = False  # True when every forward/backward is collective (FSDP2): empty micro-batches are kept

    def __init__(self, ctx: DistContext, model: torch.nn.Module) -> None:
        self.ctx = ctx
        self.generation_model = model  # what the engines generate with: the policy itself
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad(), ctx.collective("broadcast of rank 0's starting weights"):
            for p in model.parameters():  # identical starting weights whatever each rank loaded
                dist.broadcast(p.data, src=0)

    def sync_generation_model(self) -> None:
        """Nothing to do: the engines generate with the policy module itself."""

    def micro_batches(self, rows: torch.Tensor, size: int, lengths: torch.Tensor | None = None,
                      max_tokens: int = 0) -> list[torch.Tensor]:
        """This rank's micro-batches of a mini-batch: an equal row share (sizes differ by at most one), cut into
        as many micro-batches as the largest share needs, on every rank (empty ones dropped unless `lockstep`).
        With a token budget each share is cut by split_rows, and under `lockstep` every rank runs as many
        micro-batches as the rank needing most (each rank knows every share: no collective)."""
        shares = rows.tensor_split(self.ctx.world_size)
        share = shares[self.ctx.rank]
        if max_tokens > 0:
            mine = split_rows(share, size, lengths, max_tokens)
            if self.lockstep:
                most = max(len(split_rows(s, size, lengths, max_tokens)) for s in shares)
                mine += [share[:0]] * (most - len(mine))
            return [m for m in mine if m.numel() > 0 or self.lockstep]
        count = max(1, math.ceil(math.ceil(rows.numel() / self.ctx.world_size) / size))
        return [m for m in share.tensor_split(count) if m.numel() > 0 or self.lockstep]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (CPU tensors go through the gloo group)."""
        with self.ctx.collective("all_reduce of a sum"):
            dist.all_reduce(t, group=self.ctx.cpu_group if t.device.type == "cpu" else None)
        return t

    def sum(self, value: float) -> float:
        return float(self.all_reduce_(torch.tensor([value], dtype=torch.float64)).item())

    def grad_sync(self) -> None:
        """Sum of the accumulated gradients over ranks: one flat all-reduce per dtype.

        A rank with no rows in a mini-batch has no gradients: it sends zeros, and a parameter no rank produced a
        gradient for keeps `grad = None` (so the optimiser skips it, as in one process)."""
        if not self.params:
            return
        had = torch.tensor([float(p.grad is not None) for p in self.params], device=self.params[0].device)
        with self.ctx.collective("all_reduce of which gradients exist (grad_sync)"):
            dist.all_reduce(had)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.all_reduce_tensors_([p.grad for p in self.params])
        for p, count in zip(self.params, had.tolist()):
            if count == 0:
                p.grad = None

    def all_reduce_tensors_(self, tensors: list[torch.Tensor]) -> None:
        """In-place sum over ranks of same-device tensors: one flat all-reduce per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            with self.ctx.collective("all_reduce of the gradients"):
                dist.all_reduce(flat)
            for t, summed in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(summed.view_as(t))

    def reduce_metrics(self, sums: dict, weight_sums: dict, exclude: tuple[str, ...] = ()) -> None:
        """Sum the (value, weight) metric accumulators over ranks in place; `exclude` holds keys already global."""
        local = {k: (sums[k], weight_sums[k]) for k in sums if k not in exclude}
        gathered: list = [None] * self.ctx.world_size
        with self.ctx.collective("all_gather_object of the update's metrics"):
            dist.all_gather_object(gathered, local, group=self.ctx.cpu_group)
        for k in {k for part in gathered for k in part}:
            sums[k] = sum(part[k][0] for part in gathered if k in part)
            weight_sums[k] = sum(part[k][1] for part in gathered if k in part)


class NullLogger:
    """Metrics logger of ranks other than 0."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass
