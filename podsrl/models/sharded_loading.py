"""The policy (or the frozen reference) loaded straight into FSDP2's layout under torchrun (`train.strategy: fsdp`):
no rank holds the whole model on its device at any point.

Every rank builds the architecture with its parameters on the meta device (rank 0's config and tokenizer, and with
LoRA the same adapters: rank_loading.Blueprint), has it sharded (`shard`: podsrl/fsdp.py applies fully_shard and
allocates this rank's shards only) and receives its shards from rank 0. Rank 0 reads one tensor at a time in the
master dtype and scatters its rows: rank r gets rows [r c, (r + 1) c) of each parameter, c = ceil(rows / N), which
is how FSDP2 shards (torch.chunk on dim 0). Buffers (the rotary frequencies) are small and whole on every rank:
rank 0's are broadcast.

Where rank 0 reads from: a safetensors checkpoint (a local model directory, a hub id's snapshot, the warm-up cache,
a checkpoint's model/) is read tensor by tensor with plain file reads (safetensors_stream.py), so rank 0's host
memory holds one tensor at a time too. Anything else (the built-in model, built from code; a .bin checkpoint; a LoRA
policy, whose fresh or saved adapters peft makes; names or shapes that differ from the architecture's) is loaded
whole into rank 0's host memory as one process would load it, and scattered from there: the devices still hold only
shards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from podsrl.models.rank_loading import Blueprint, model_tensors, tensor_list
from podsrl.models.safetensors_stream import SafetensorsDirectory

if TYPE_CHECKING:
    from podsrl.config import ModelConfig
    from podsrl.distributed import DistContext

log = logging.getLogger("podsrl")

Loader = Callable[[], tuple[torch.nn.Module, object]]  # the one-process load: (model, tokenizer)
Adapt = Callable[[torch.nn.Module], torch.nn.Module]


def load_sharded(cfg: ModelConfig, ctx: DistContext, shard: Callable[[torch.nn.Module], None], path: str | None,
                 one_process: Loader, adapt: Adapt | None = None) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) with the model sharded by `shard`, its shards filled from rank 0. `path` is the weights'
    directory or hub id (None: cfg.name_or_path); `one_process` loads the whole model as one process would, on rank 0
    only, where `path` cannot be streamed; `adapt` wraps the architecture as `one_process` does (LoRA), which is never
    streamed. Collective: every rank calls it, in the same order."""
    source: Streamed | Whole | None = None
    if ctx.is_main:
        source = (Streamed.open(path or cfg.name_or_path, cfg) if adapt is None else None) or Whole(*one_process())
    blueprint: Blueprint = ctx.from_main(source.blueprint if source is not None else None)
    model = blueprint.build_empty(cfg, adapt)
    shard(model)
    try:
        fill_shards(model, source, ctx)
    finally:
        if source is not None:
            source.close()
    # rank 0 alone drew what its load initialises (LoRA's fresh adapters): its RNG goes on from there on every rank,
    # as when each rank loaded the model itself
    torch.set_rng_state(ctx.from_main(torch.get_rng_state()))
    return model, blueprint.tokenizer


class Streamed:
    """Rank 0's weights read one tensor at a time from a safetensors checkpoint whose names and shapes are the
    architecture's own (what from_pretrained would load without renaming or reshaping anything)."""

    def __init__(self, files: SafetensorsDirectory, blueprint: Blueprint, names: dict[str, str]) -> None:
        self.files, self.blueprint, self.names = files, blueprint, names

    @classmethod
    def open(cls, path: str, cfg: ModelConfig) -> Streamed | None:
        """None, with the reason logged, where the weights are not such a checkpoint."""
        directory = local_weights(path)
        if directory is None or not SafetensorsDirectory.holds_weights(directory):
            log.info("loading into shards: %s is not a safetensors checkpoint; rank 0 loads it whole into host "
                     "memory and sends each rank its shards", path)
            return None
        from transformers import AutoConfig, GenerationConfig

        from podsrl.models.loading import load_tokenizer

        config = AutoConfig.from_pretrained(str(directory), trust_remote_code=cfg.trust_remote_code)
        try:
            generation = GenerationConfig.from_pretrained(str(directory))
        except OSError:  # no generation_config.json: from_pretrained derives it from the model's config
            generation = GenerationConfig.from_model_config(config)
        blueprint = Blueprint(config, generation, load_tokenizer(str(directory), cfg.trust_remote_code),
                              training=False, tensors=None, trainable=None)
        skeleton = blueprint.build_empty(cfg)
        blueprint.tensors = tensor_list(skeleton)
        files = SafetensorsDirectory(directory)
        names, problem = {}, None
        for name, tensor in model_tensors(skeleton):
            if name in files.entries:
                names[name] = name
            elif name in dict(skeleton.named_parameters()) or name in persistent_buffers(skeleton):
                problem = f"it has no tensor {name}"
                break
            else:
                continue  # a non-persistent buffer: the constructor's values, as from_pretrained keeps them
            if files.shape(name) != tuple(tensor.shape) or files.dtype(name) is None:
                problem = f"its {name} is {files.entries[name][2]['dtype']} {files.shape(name)}"
                break
        if problem is not None:
            files.close()
            log.info("loading into shards: %s does not match the architecture one to one (%s); rank 0 loads it "
                     "whole into host memory and sends each rank its shards", path, problem)
            return None
        return cls(files, blueprint, names)

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The whole tensor in `dtype` on the CPU (None: a buffer the constructor made, kept as rank 0 has it)."""
        if name not in self.names:
            return None
        stored = self.files.read(self.names[name])
        return stored if stored.dtype == dtype else stored.to(dtype)

    def close(self) -> None:
        self.files.close()


class Whole:
    """Rank 0's weights as one process loads them, whole in host memory."""

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model, self.blueprint = model, Blueprint.of(model, tokenizer)
        self.tensors = dict(model_tensors(model))

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.tensors[name].detach().to(dtype)

    def close(self) -> None:
        self.tensors.clear()
        self.model = None


def local_weights(path: str) -> Path | None:
    """The local directory of a model directory or a hub id's snapshot (its weights fetched if missing); None for
    the built-in model or what cannot be found."""
    if path == "tiny":
        return None
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                            "tokenizer*"]))
    except Exception:  # offline, no such repo, a file path: the one-process load says why, in its own words
        return None


def persistent_buffers(model: torch.nn.Module) -> set[str]:
    return set(model.state_dict()) - {name for name, _ in model.named_parameters(remove_duplicate=False)}


@torch.no_grad()
def fill_shards(model: torch.nn.Module, source: Streamed | Whole | None, ctx: DistContext) -> None:
    """Every parameter's shards from rank 0's `source` by scatter, every buffer by broadcast, one tensor at a time
    (collective; `source` is None on the other ranks)."""
    for name, tensor in model_tensors(model):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        group = ctx.cpu_group if local.device.type == "cpu" else None  # gloo for host tensors under nccl
        whole = source.tensor(name, tensor.dtype) if source is not None else None
        whole = whole.to(local.device) if whole is not None else None
        if isinstance(tensor, DTensor):
            if tuple(tensor.placements) != (Shard(0),):
                raise RuntimeError(f"{name}: sharded as {tensor.placements}; loading fills dim-0 shards only")
            scatter_rows(whole, local, tensor.shape, ctx, group)
        else:
            if whole is not None:
                local.copy_(whole)
            dist.broadcast(local, src=0, group=group)


def scatter_rows(whole: torch.Tensor | None, local: torch.Tensor, shape: torch.Size, ctx: DistContext,
                 group) -> None:
    """Rank r's rows [r c, (r + 1) c) of rank 0's `whole` into `local` (FSDP2's dim-0 shard, c = ceil(rows / N):
    the last ranks may have fewer rows, or none); rows a rank lacks travel as padding."""
    chunk = -(-shape[0] // ctx.world_size)
    into = local if local.shape[0] == chunk else local.new_empty((chunk, *shape[1:]))
    pieces = None
    if ctx.is_main:
        pieces = list(whole.split(chunk))
        if pieces and pieces[-1].shape[0] < chunk:
            short = pieces.pop()
            pieces.append(torch.cat([short, short.new_zeros((chunk - short.shape[0], *shape[1:]))]))
        pieces += [whole.new_zeros((chunk, *shape[1:]))] * (ctx.world_size - len(pieces))
    dist.scatter(into, pieces, src=0, group=group)
    if into is not local:
        local.copy_(into[: local.shape[0]])
