"""FSDP2 data parallelism (`train.strategy: fsdp` under torchrun): parameters, gradients and AdamW state sharded
over the ranks with `torch.distributed.fsdp.fully_shard`, so a model whose training state outgrows one device
still trains. The loop, the rank agreement and the sharded generation are those of podsrl/distributed.py; only the
update's data-parallel object changes, behind the same interface as `DataParallel`.

- Sharding: `fully_shard` on every decoder layer (the model's `_no_split_modules`), then on the root. Compute runs in
  `train.fsdp_param_dtype` = `model.compute_dtype` (one setting; bfloat16 on CUDA, float32 on CPU), gradients are reduce-scattered in
  `train.fsdp_reduce_dtype` (float32), the sharded master weights and AdamW state stay in `model.dtype`;
  `train.cpu_offload` keeps the shards in host memory.
- Gradients: the updater's loss weights already normalise over the whole mini-batch, so gradients must be SUMMED over
  ranks. FSDP2 averages by default; here the divide factor is 1 and only plain sums are used (gloo has no
  pre-multiplied sum), so the sharded gradient equals the one-process gradient.
- Lockstep: FSDP2 all-gathers parameters in every forward and reduce-scatters in every backward, so every rank must
  run the same number of forward and backward passes. `micro_batches` gives every rank the same number of
  micro-batches, empty ones included (down-sampling keeping few rows, uneven groups, one row for two ranks); the model runs
  an empty micro-batch on one dummy row and returns zero rows still attached to the graph, so that rank joins the
  collectives with zero loss and zero gradient. Nothing else in the update is collective per micro-batch.
- Clipping: `clip_grad_norm_` over the sharded (DTensor) gradients returns the global norm.
- Generation: engines never see the sharded module. Each rank keeps one plain copy of the policy in the compute
  dtype (the generation model); after each update the trainable parameters are gathered into it once, one
  all-gather per parameter. In-process engines generate with it, the Ray pool puts it once into the object store,
  vLLM loads from it. Checkpoints save it as the transformers-loadable `model/` and the sharded state beside it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from podsrl.distributed import DataParallel, DistContext, log
from podsrl.models.precision import resolve_compute_dtype


def build_data_parallel(ctx: DistContext, model: torch.nn.Module, ref_model: torch.nn.Module | None = None,
                        cfg=None, generation_device: torch.device | None = None) -> DataParallel | None:
    """The update's data-parallel object: DataParallel, or FSDP2 with `train.strategy: fsdp` (which shards `model`
    and `ref_model` in place); None in one process. Lives here, not in podsrl/distributed.py, so that this module
    builds on that one and not the other way round."""
    fsdp = cfg is not None and cfg.train.strategy == "fsdp"
    if not ctx.enabled:
        if fsdp:
            log.info("train.strategy=fsdp: one process, nothing to shard; training the whole model here")
        return None
    if fsdp:
        return FullyShardedDataParallel(ctx, cfg, model, ref_model, generation_device)
    return DataParallel(ctx, model)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class transformers lists in `_no_split_modules` (decoder layers),
    found through wrappers such as peft's."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def run_empty_on_one_row(model: torch.nn.Module) -> None:
    """A forward on zero rows (a rank's padding micro-batch) runs on one dummy row and returns its logits sliced to
    zero rows: the all-gathers of the forward and the reduce-scatters of the backward still happen, with zero
    gradient. (transformers models cannot run on an empty batch.)"""
    padded = [False]

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids")
        padded[0] = ids is not None and ids.shape[0] == 0
        if padded[0]:
            width = ids.shape[1]
            kwargs = {**kwargs, "input_ids": ids.new_zeros(1, width), "attention_mask": ids.new_ones(1, width)}
            if kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = torch.arange(width, device=ids.device)[None]
        return args, kwargs

    def after(module, args, kwargs, output):
        if padded[0]:
            output.logits = output.logits[:0].clone()  # a copy: FSDP2 warns on views
        return output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


class FullyShardedDataParallel(DataParallel):
    """FSDP2 behind the updater's data-parallel interface (see the module docstring). Shards `model` (and the
    frozen `ref_model`) in place; build the optimiser afterwards, over the sharded parameters."""

    sharded = True
    lockstep = True  # every forward/backward is collective: empty micro-batches are run, not dropped

    def __init__(self, ctx: DistContext, cfg: Any, model: torch.nn.Module,
                 ref_model: torch.nn.Module | None = None, generation_device: torch.device | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        self.ctx, self.model = ctx, model
        with torch.no_grad():  # identical starting weights whatever each rank loaded
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
        # the compute dtype (model.compute_dtype and train.fsdp_param_dtype are one setting: podsrl/models/precision.py)
        train_cfg = cfg.train
        dtype = resolve_compute_dtype(cfg, ctx.device)
        # One unsharded copy for the engines (see sync_generation_model); on CPU (the Ray pool's) in float32.
        generation_device = generation_device or ctx.device
        self.generation_model = copy.deepcopy(model).to(
            generation_device, resolve_compute_dtype(cfg, generation_device)).eval()
        self.mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        options: dict[str, Any] = {
            "mesh": self.mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=dtype,
                                              reduce_dtype=getattr(torch, train_cfg.fsdp_reduce_dtype)),
        }
        if train_cfg.cpu_offload and ctx.device.type == "cuda":  # on CPU the shards are in host memory anyway
            options["offload_policy"] = CPUOffloadPolicy()
        for module in (model, ref_model):
            if module is None:
                continue
            run_empty_on_one_row(module)
            shard_model(module, options, train_cfg.fsdp_reshard_after_forward)

    def grad_sync(self) -> None:
        """Nothing left to do: each backward reduce-scattered (summed) its gradients into the shards."""

    @torch.no_grad()
    def sync_generation_model(self) -> None:
        """Gathers the trainable parameters into the generation model (collective: every rank, same order).
        Frozen ones (a LoRA base) never change and are not gathered."""
        mirror = dict(self.generation_model.named_parameters())
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                mirror[name].copy_(full_tensor(p, self.ctx.device))

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
        """(sharded tensors for torch.distributed.checkpoint, the optimiser's param groups as plain values)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, optimizer)
        return {"model": model_state, "optimizer": optim_state["state"]}, optim_state["param_groups"]

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, tensors: dict, param_groups: list) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, optimizer, model_state_dict=tensors["model"],
                       optim_state_dict={"state": tensors["optimizer"], "param_groups": param_groups})
        self.sync_generation_model()


def shard_model(model: torch.nn.Module, options: dict, reshard_after_forward: bool) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)
    for module in model.modules():  # sum, not average; plain SUM collectives (gloo has no PREMUL_SUM)
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def full_tensor(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor of a sharded parameter; CPU-offloaded shards travel through the compute device."""
    if not isinstance(p, DTensor):
        return p
    if p.to_local().device.type != device.type:
        p = DTensor.from_local(p.to_local().to(device), p.device_mesh, p.placements, shape=p.shape,
                               stride=p.stride())
    return p.full_tensor()
