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
  dtype (the generation model), allocated in that dtype and filled from the shards one gathered parameter at a time
  (never a whole copy in the master dtype); after each update the trainable parameters are gathered into it once.
  In-process engines generate with it, its q/k/v and gate/up projections views of the fused tensors the decode loop
  reads (no second copy of them); the Ray pool puts it once into the object store, vLLM loads from it. Checkpoints
  save it as the transformers-loadable `model/` and the sharded state beside it.
- Start-up: `Sharding.shard` takes modules built on the meta device (podsrl/models/sharded_loading.py), so a rank
  allocates only its shards and receives them from rank 0; whole models handed to FullyShardedDataParallel are
  sharded in place (the same layout).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from podsrl.config.facts import RunFacts, run_facts
from podsrl.distributed import DataParallel, DistContext, log
from podsrl.models.decode import share_fused_weights


def build_data_parallel(ctx: DistContext, model: torch.nn.Module, ref_model: torch.nn.Module | None = None,
                        cfg=None, facts: RunFacts | None = None,
                        sharding: Sharding | None = None) -> DataParallel | None:
    """The update's data-parallel object: DataParallel, or FSDP2 with `train.strategy: fsdp` (over the modules
    `sharding` sharded as they were loaded, or sharding `model` and `ref_model` in place); None in one process.
    FSDP2 reads its dtypes and the generation copy's device from `facts` (the run's; `cfg`'s on this rank's device
    when none is given).
    Lives here, not in podsrl/distributed.py, so that this module builds on that one and not the other way round."""
    fsdp = cfg is not None and cfg.train.strategy == "fsdp"
    if not ctx.enabled:
        if fsdp:
            log.info("train.strategy=fsdp: one process, nothing to shard; training the whole model here")
        return None
    if fsdp:
        return FullyShardedDataParallel(ctx, cfg, model, ref_model, facts or run_facts(cfg, ctx.device), sharding)
    return DataParallel(ctx, model)


def fsdp_sharding(ctx: DistContext, cfg, compute_dtype: torch.dtype) -> Sharding | None:
    """How this run shards its models as it loads them (computing in `compute_dtype`, the run's): under torchrun
    with train.strategy=fsdp, else None."""
    return Sharding(ctx, cfg, compute_dtype) if ctx.enabled and cfg.train.strategy == "fsdp" else None


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


class Sharding:
    """FSDP2's layout over the ranks (the mesh, the mixed-precision and offload policies) and, for each module it
    sharded, that module's unsharded skeleton on the meta device (no memory): what the generation copy is built on."""

    def __init__(self, ctx: DistContext, cfg: Any, compute_dtype: torch.dtype) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        train_cfg = cfg.train
        self.mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        # the run's compute dtype (model.compute_dtype and train.fsdp_param_dtype are one setting, resolved in RunFacts)
        self.options: dict[str, Any] = {
            "mesh": self.mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype,
                                              reduce_dtype=getattr(torch, train_cfg.fsdp_reduce_dtype)),
        }
        offload = train_cfg.cpu_offload and ctx.device.type == "cuda"  # on CPU the shards are in host memory anyway
        if offload:
            self.options["offload_policy"] = CPUOffloadPolicy()
        self.shard_device = torch.device("cpu") if offload else ctx.device
        self.reshard_after_forward = train_cfg.fsdp_reshard_after_forward
        self.skeletons: dict[int, torch.nn.Module] = {}

    def shard(self, module: torch.nn.Module) -> None:
        """Shards `module` in place. One built on the meta device then gets this rank's shards allocated (empty:
        the loader fills them) and its buffers, which allocating replaces, back."""
        self.skeletons[id(module)] = meta_copy(module)
        run_empty_on_one_row(module)
        shard_model(module, self.options, self.reshard_after_forward)
        if any(p.is_meta for p in module.parameters()):
            buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
            module.to_empty(device=self.shard_device)
            with torch.no_grad():
                for name, b in module.named_buffers():
                    b.copy_(buffers[name])

    def skeleton(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.skeletons[id(module)]


class FullyShardedDataParallel(DataParallel):
    """FSDP2 behind the updater's data-parallel interface (see the module docstring). Takes the modules `sharding`
    sharded as they were loaded, or shards whole ones (`model` and the frozen `ref_model`) in place; build the
    optimiser afterwards, over the sharded parameters."""

    sharded = True
    lockstep = True  # every forward/backward is collective: empty micro-batches are run, not dropped

    def __init__(self, ctx: DistContext, cfg: Any, model: torch.nn.Module,
                 ref_model: torch.nn.Module | None, facts: RunFacts, sharding: Sharding | None = None) -> None:
        self.ctx, self.model = ctx, model
        if sharding is None:  # whole models on every rank: rank 0's values everywhere, then sharded in place
            sharding = Sharding(ctx, cfg, facts.compute_dtype)
            with torch.no_grad():
                for p in model.parameters():
                    dist.broadcast(p.data, src=0)
            for module in (model, ref_model):
                if module is not None:
                    sharding.shard(module)
        self.mesh = sharding.mesh
        # One unsharded copy for the engines (see sync_generation_model); on CPU (the Ray pool's) in float32.
        self.generation_model = generation_copy(sharding.skeleton(model), facts.generation_dtype,
                                                facts.generation_device)
        self.sync_generation_model(frozen_too=True)
        if cfg.rollout.engine_type.in_process:  # pickled to workers, views of one tensor would each carry it all
            share_fused_weights(self.generation_model)

    def grad_sync(self) -> None:
        """Nothing left to do: each backward reduce-scattered (summed) its gradients into the shards."""

    @torch.no_grad()
    def sync_generation_model(self, frozen_too: bool = False) -> None:
        """Gathers the trainable parameters into the generation model (collective: every rank, same order), each
        cast to its dtype before the all-gather. Frozen ones (a LoRA base) never change: gathered once, at start."""
        mirror = dict(self.generation_model.named_parameters())
        for name, p in self.model.named_parameters():
            if p.requires_grad or frozen_too:
                mirror[name].copy_(full_tensor(p, self.ctx.device, mirror[name].dtype))

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


def meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """`module`'s structure with its parameters on the meta device (no memory; tied ones tied) and its buffers
    copied."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(module, memo)


def generation_copy(skeleton: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """An unsharded module of `skeleton`'s structure with empty parameters in `dtype` on `device` (to be gathered
    into) and the skeleton's buffers as they are (the rotary frequencies stay float32, as from_pretrained keeps them
    in any dtype)."""
    memo: dict[int, Any] = {}
    for p in skeleton.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                         requires_grad=p.requires_grad)
    for b in skeleton.buffers():
        memo[id(b)] = b.to(device, copy=True)
    return copy.deepcopy(skeleton, memo).eval()


def full_tensor(p: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor of a sharded parameter, in `dtype` (cast before the all-gather: only the shard is ever in
    the parameter's own dtype); CPU-offloaded shards travel through the compute device."""
    if not isinstance(p, DTensor):
        return p if dtype is None else p.to(dtype)
    local = p.to_local()
    if local.device.type != device.type or (dtype is not None and local.dtype != dtype):
        local = local.to(device, dtype)
        p = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return p.full_tensor()
