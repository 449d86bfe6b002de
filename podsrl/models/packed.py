"""The update's packed forward: log-probs and entropies of a micro-batch laid out as one packed token stream
(podsrl/models/packed_layout.py), each distinct prompt run once and completions without padding.

The decoder layers are the one layer of podsrl/models/llama.py with `autograd=True` (RMSNorm, the q/k/v rotation and
the SwiGLU gating as the autograd functions of kernels.py: fewer passes over the stream than autograd's own
decomposition, which on CPU is most of the non-matmul time) and attention over the packed blocks. Only positions
that predict a completion token reach the output layer, through chunked log-probs/entropy (never a [tokens, vocab]
float32 tensor). Log-probs, entropies and gradients equal the plain path's up to float rounding
(tests/update/test_shared_prompt.py; sharded, tests/distributed/test_fsdp.py). Llama, Mistral, Qwen2 and Qwen3 models, LoRA-wrapped
ones included; `packed_forward_problem` says why another model takes the plain path.

Module hooks (FSDP2): the computation still enters through the model's and each decoder layer's own `__call__`, with
their `forward` swapped for this path's computation for the duration of the call (`_routed`). So whatever is hooked
on those modules runs as around their own forward: FSDP2's `fully_shard` (podsrl/fsdp.py shards each decoder layer,
then the root) all-gathers the unit's parameters before, reshards after, re-gathers them in the backward and
reduce-scatters the gradients after it; the root's hooks queue the end-of-backward callback. Nothing FSDP-specific
is needed here, and one process or DDP runs the same code. Explicit `unshard()` of each unit would gather the
parameters but skip the forward hooks that register FSDP2's backward work (re-gather, gradient reduce-scatter).

Activation checkpointing (`update.activation_checkpointing`): each layer keeps only its inputs (the [N, D] hidden
state; the plan and rotary tables are shared by all layers) and reruns in the backward (torch.utils.checkpoint,
non-reentrant, the forward's autocast state restored). It runs inside the layer's own forward, so module hooks stay
outside the checkpoint and run once, as transformers places its own (the backward's re-gather precedes the rerun).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from podsrl.models.kernels import rms_norm, signed_sin
from podsrl.models.llama import LayerPlan, decoder_layer, layer_plan
from podsrl.models.logprobs import head_logprobs_and_entropy
from podsrl.models.packed_layout import Plan, block_attention
from podsrl.models.transformers_api import (
    LLAMA_FAMILY,
    base_model,
    check_fast_path,
    is_llama_family,
    llama_layout_problem,
    own_layer_checkpointing_off,
)


def packed_forward_problem(model: torch.nn.Module) -> str | None:
    """Why the shared-prompt path cannot drive this model (None when it can). A Llama-family model whose layout
    podsrl cannot find (a transformers release moved it) is an error, not a quiet fallback."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if not is_llama_family(base):
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {', '.join(LLAMA_FAMILY)}"
    check_fast_path(model, "the shared-prompt update", llama_layout_problem(model), "update.shared_prompt: false")
    head = base.lm_head
    if type(head) is not torch.nn.Linear:
        return f"its output layer is a {type(head).__name__}, not a plain Linear (e.g. LoRA on lm_head)"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout > 0 (the plain path's dropout draws could not be reproduced)"
    other = _other_fsdp_unit(model, base.model.layers)
    if other is not None:
        return (f"{other} is an FSDP2 unit of its own: only the root and the decoder layers are called through "
                "their forward here, so its parameters would not be gathered")
    return None


def _other_fsdp_unit(model: torch.nn.Module, layers: torch.nn.ModuleList) -> str | None:
    """The name of an FSDP2-sharded module other than `model` itself and its decoder layers (None: there is none)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    called = {id(model), *(id(layer) for layer in layers)}
    return next((name for name, m in model.named_modules() if isinstance(m, FSDPModule) and id(m) not in called),
                None)


class PackedForward:
    """([B, W] log-probs, [B, W] entropies) of a packed plan's rows under a model `packed_forward_problem` accepts."""

    def __init__(self, model: torch.nn.Module, logits_chunk: int, activation_checkpointing: bool = False,
                 keep_plans: bool = False) -> None:
        self.root = model  # called as a whole: its hooks (FSDP2's root unit) run around the computation
        self.base = base_model(model)
        self.body = self.base.model
        self.head = self.base.lm_head
        self.layers = list(self.body.layers[: self.base.config.num_hidden_layers])
        self.chunk = logits_chunk
        self.checkpointing = activation_checkpointing
        # with keep_plans, each layer's plan and the (grad mode, cast) it was made for, until forget_weights (see
        # _layer_plan); none kept under FSDP2
        self.plans: dict[int, tuple[tuple, LayerPlan]] | None = {} if keep_plans and not _sharded(model) else None

    def __call__(self, plan: Plan, temperature: float) -> tuple[Tensor, Tensor]:
        """0 outside the plan's completion mask."""
        with self._routed():
            return self.root(plan, temperature)

    @contextmanager
    def _routed(self) -> Iterator[None]:
        """While open, calling the root runs `_model_forward` and calling a decoder layer runs `_layer_forward`
        (instance attributes shadow the class's `forward`; the previous state is restored on exit). Nothing else
        calls the model while an update runs (generation is not concurrent with it). The layers checkpoint here
        (`_layer_forward`), not in transformers (which may also wrap them when the plain path turned its own on)."""
        swapped = [(self.root, self._model_forward)]
        swapped += [(layer, functools.partial(self._layer_forward, i)) for i, layer in enumerate(self.layers)]
        saved = [(module, module.__dict__.get("forward")) for module, _ in swapped]
        try:
            for module, forward in swapped:
                module.forward = forward
            with own_layer_checkpointing_off(self.layers):
                yield
        finally:
            for module, previous in saved:
                if previous is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = previous

    def _model_forward(self, plan: Plan, temperature: float) -> tuple[Tensor, Tensor]:
        x = self.body.embed_tokens(plan.ids)
        cos, sin = self.body.rotary_emb(x[None], plan.positions[None])
        cos, signed = cos[0, :, None], signed_sin(sin[0, :, None])  # [N, 1, d]: broadcast over the heads
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, signed, plan, i == len(self.layers) - 1)
        hidden = rms_norm(self.body.norm, x)
        logp, entropy = head_logprobs_and_entropy(hidden, self.head.weight, self.head.bias, plan.targets,
                                                  temperature, self.chunk)
        return _rows(logp, plan), _rows(entropy, plan)

    def _layer_forward(self, index: int, x: Tensor, cos: Tensor, signed: Tensor, plan: Plan, last: bool) -> Tensor:
        """Runs as the layer's own forward, so its plan binds the parameters FSDP2 has just gathered; after the last
        layer only predicting positions are read."""
        keep = plan.pred_index if last else None
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._layer, index, x, cos, signed, plan, keep, use_reentrant=False)
        return self._layer(index, x, cos, signed, plan, keep)

    def _layer(self, index: int, x: Tensor, cos: Tensor, signed: Tensor, plan: Plan, keep: Tensor | None) -> Tensor:
        return decoder_layer(self._layer_plan(index), x, cos, signed, functools.partial(_block_attend, plan), keep)

    def forget_weights(self) -> None:
        """Drops the kept plans: the weights changed (an optimiser step; the fused AdamW step changes them without
        bumping their version counters, so the caller says so) or the update is over (their memory freed)."""
        if self.plans is not None:
            self.plans.clear()

    def _layer_plan(self, index: int) -> LayerPlan:
        """The layer's plan, its fused q/k/v and gate/up weights concatenated and cast to autocast's dtype; with
        keep_plans made once until forget_weights, not in every micro-batch: each micro-batch's backward runs back
        through the same concatenation and cast (which save no tensors), and a forward keeps the fused weights for
        its backward anyway, so the peak memory is the same. Under FSDP2 the parameters are gathered anew for each
        call, so the plan is made each time."""
        layer = self.layers[index]
        kind = layer.self_attn.o_proj.weight.device.type
        cast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        if self.plans is None:
            return layer_plan(layer, index, self.base.config, autograd=True, cast=cast)
        state = (torch.is_grad_enabled(), cast)
        kept = self.plans.get(index)
        if kept is None or kept[0] != state:
            kept = self.plans[index] = (state, layer_plan(layer, index, self.base.config, autograd=True, cast=cast))
        return kept[1]


def _sharded(model: torch.nn.Module) -> bool:
    """Whether some module of `model` is an FSDP2 unit."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch builds without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _rows(values: Tensor, plan: Plan) -> Tensor:
    """[T] values per predicted token -> [B, W], 0 elsewhere. By index, not by the bool mask: masked_scatter's
    backward (masked_select) reads the mask's count on the host, a sync per micro-batch. Written through a flat view
    into a tensor of its own, which is returned: the root's output is no view (FSDP2 warns on views, whose in-place
    changes would skip its pre-backward hook)."""
    rows = torch.zeros(plan.output_shape, dtype=values.dtype, device=values.device)
    rows.view(-1).index_copy_(0, plan.output_index, values)
    return rows


def _block_attend(plan: Plan, layer: LayerPlan, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return block_attention(q, k, v, plan, layer.scaling)
