"""The policy under torchrun, read from disk once per job: rank 0 loads it as one process would (`load_policy`);
every other rank builds the same architecture on the meta device, allocates it empty on its own device and receives
each parameter and buffer from rank 0 by broadcast, one tensor at a time. The host memory of a node then holds the
weights read from disk once, not once per rank, and every rank starts from rank 0's tensors bit for bit (tied
weights still tied, non-persistent buffers such as the rotary frequencies included). In one process this is
`load_policy` itself. Under FSDP2 the model goes straight into its shards instead (podsrl/models/sharded_loading.py,
with this module's Blueprint)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from podsrl.models.loading import load_policy

if TYPE_CHECKING:  # types only: models/ stand below config/ and distributed.py
    from podsrl.config import ModelConfig
    from podsrl.distributed import DistContext


def load_policy_on_ranks(cfg: ModelConfig, base_path: str | None = None, seed: int = 0,
                         ctx: DistContext | None = None):
    """(model, tokenizer) as `load_policy` gives them; under torchrun on ctx.device, the weights read by rank 0
    alone (see the module docstring). Collective: every rank calls it, in the same order."""
    if ctx is None or not ctx.enabled:
        return load_policy(cfg, base_path, seed)
    if ctx.is_main:
        model, tokenizer = load_policy(cfg, base_path, seed)
        model.to(ctx.device)
    blueprint = ctx.from_main(Blueprint.of(model, tokenizer) if ctx.is_main else None)
    if not ctx.is_main:
        model, tokenizer = blueprint.build(cfg, ctx.device), blueprint.tokenizer
    group = ctx.cpu_group if ctx.device.type == "cpu" else None  # the gloo group for CPU tensors under nccl
    with torch.no_grad():
        for _, tensor in model_tensors(model):
            dist.broadcast(tensor, src=0, group=group)
    return model, tokenizer


def model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter (a tied one once) and every buffer (non-persistent ones too), in module order."""
    return [*model.named_parameters(), *model.named_buffers()]


@dataclass
class Blueprint:
    """What a rank needs from rank 0 to build the same model without reading its weights."""

    config: Any
    generation_config: Any
    tokenizer: Any
    training: bool
    tensors: list[tuple[str, torch.Size, torch.dtype]] | None  # model_tensors' names, shapes, dtypes on rank 0
    trainable: list[str] | None = None  # the parameters that require gradients on rank 0 (None: all)

    @classmethod
    def of(cls, model: torch.nn.Module, tokenizer) -> Blueprint:
        return cls(model.config, getattr(model, "generation_config", None), tokenizer, model.training,
                   tensor_list(model), [n for n, p in model.named_parameters() if p.requires_grad])

    def build(self, cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
        """The architecture with uninitialised tensors on `device`, to be filled by the broadcasts."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, dtype=getattr(torch, cfg.dtype),
                                                     trust_remote_code=cfg.trust_remote_code)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gives each module a tensor of its own: the output head would leave the embedding
        model.generation_config = self.generation_config
        model.train(self.training)
        self.check(model)
        return model

    def build_empty(self, cfg: ModelConfig,
                    adapt: Callable[[torch.nn.Module], torch.nn.Module] | None = None) -> torch.nn.Module:
        """The architecture with its parameters on the meta device (no memory; tied ones tied) and its buffers as the
        constructor computes them, then `adapt` (LoRA's wrapper) applied, for sharding before anything is allocated."""
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(self.config, dtype=getattr(torch, cfg.dtype),
                                                     trust_remote_code=cfg.trust_remote_code)
            if self.generation_config is not None:
                model.generation_config = self.generation_config
            if adapt is not None:
                model = adapt(model)
        if self.trainable is not None:
            trainable = set(self.trainable)
            for name, p in model.named_parameters():
                p.requires_grad_(name in trainable)
        model.train(self.training)
        self.check(model)
        return model

    def check(self, model: torch.nn.Module) -> None:
        """Stops when this rank's build differs from rank 0's: a transfer into other shapes or dtypes would hang or
        copy garbage. (None: rank 0's own first build, nothing to compare with.)"""
        built = tensor_list(model)
        if self.tensors is not None and built != self.tensors:
            theirs, mine = next((a, b) for a, b in zip([*self.tensors, None], [*built, None]) if a != b)
            raise RuntimeError(f"rank {dist.get_rank()} built {type(model).__name__} from rank 0's config, but its "
                               f"tensors differ from rank 0's: {mine} here, {theirs} on rank 0")


def tensor_list(model: torch.nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(name, t.shape, t.dtype) for name, t in model_tensors(model)]


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside hold no parameter memory: each parameter is re-homed on the meta device as it is
    registered (initialisers then run on nothing), while buffers (the rotary frequencies) are computed as the
    constructor computes them. One 7B model is then built in seconds on no memory, buffers included."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":  # a parameter tied again keeps its meta object
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
