"""The one place podsrl touches transformers' internals that move between releases.

Everything that is not a public, stable entry point (`from_pretrained`, `generate`, the model's forward as a plain
call) goes through here: the name of forward's KV-cache argument (`past_key_values` up to 5.23, `cache` from 5.24),
the cache classes the fast engine builds on, the per-layer activation checkpointing (its switch's name and where it
wraps a layer, both changed in 5.24), and the peft wrapper's base model. A release that renames something is
then absorbed in this file and nowhere else; `check_fast_path` turns what cannot be absorbed into one line naming the
installed version.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import transformers

from podsrl.errors import UserError

try:
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - present in every transformers release pyproject admits
    Cache = DynamicCache = DynamicLayer = None  # type: ignore[assignment,misc]

VERSION = transformers.__version__

# forward's KV-cache argument, newest name first
CACHE_ARGUMENTS = ("cache", "past_key_values")

# Model types whose decoder stack podsrl drives itself (embed -> rotary -> Llama-layout layers -> norm -> lm_head),
# and the submodules it reaches into to do so.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
DECODER_STACK = ("embed_tokens", "rotary_emb", "layers", "norm")
LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def model_context(model: torch.nn.Module) -> int | None:
    """Longest sequence (prompt + completion) the model's positions cover, or None when it does not say."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (its layers carry the adapters in place); else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft wrapper (LoRA adapters that `adapters_disabled` can switch off)."""
    return base_model(model) is not model


def adapters_disabled(model: torch.nn.Module):
    """A context in which a peft wrapper runs its base model alone (the adapters bypassed in place, no copy)."""
    return model.disable_adapter()


def cache_argument(model: torch.nn.Module) -> str | None:
    """The name under which `model.forward` takes a KV cache in the installed transformers (None: it takes none)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), None)


def forward_with_cache(model: torch.nn.Module, cache, **inputs):
    """`model(**inputs)` reading and extending `cache`, whatever the installed release calls that argument."""
    name = cache_argument(model)
    if name is None:
        raise TypeError(f"{type(model).__name__}.forward takes no KV cache (transformers {VERSION})")
    return model(**inputs, **{name: cache}, use_cache=True)


def new_dynamic_cache(model: torch.nn.Module):
    return DynamicCache(config=model.config)


def enable_layer_checkpointing(model: torch.nn.Module) -> None:
    """transformers' own per-layer activation checkpointing, non-reentrant (`activation_checkpointing_enable` from
    5.24, `gradient_checkpointing_enable` before)."""
    base = base_model(model)
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextmanager
def own_layer_checkpointing_off(layers: list[torch.nn.Module]) -> Iterator[None]:
    """While open, transformers' per-layer checkpointing leaves `layers` alone, for a caller that replaces their
    forward and checkpoints it itself. From 5.24 transformers wraps the class's `forward`, which an instance's
    `forward` already shadows; before, it wraps the module call, which would nest a second checkpoint around the
    caller's (and its recompute then saves different tensors than the forward did)."""
    saved = [layer.__dict__.get("gradient_checkpointing") for layer in layers]
    try:
        for layer in layers:
            layer.gradient_checkpointing = False
        yield
    finally:
        for layer, previous in zip(layers, saved):
            if previous is None:
                layer.__dict__.pop("gradient_checkpointing", None)
            else:
                layer.gradient_checkpointing = previous


def is_llama_family(model: torch.nn.Module) -> bool:
    return getattr(getattr(base_model(model), "config", None), "model_type", None) in LLAMA_FAMILY


def llama_layout_problem(model: torch.nn.Module) -> str | None:
    """What podsrl reaches into is missing from this model's Llama decoder layout (None: all of it is there)."""
    base = base_model(model)
    body = getattr(base, "model", None)
    if body is None or not all(hasattr(body, n) for n in DECODER_STACK) or not hasattr(base, "lm_head"):
        return f"{type(base).__name__} has no {'/'.join(DECODER_STACK)} decoder stack and lm_head"
    for layer in body.layers:
        if not all(hasattr(layer, n) for n in LAYER_PARTS) or not all(
                hasattr(layer.self_attn, n) for n in ATTENTION_PARTS):
            return f"decoder layer {type(layer).__name__} does not have the Llama layout"
    if rotary_function(body.layers[0]) is None:
        return f"{type(body.layers[0].self_attn).__module__} has no apply_rotary_pos_emb"
    return None


def sliding_window(model: torch.nn.Module) -> int | None:
    """The smallest attention window of any layer (None: full attention everywhere)."""
    config = base_model(model).config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None and all(t == "full_attention" for t in types):
        return None
    return window


def rotary_function(layer: torch.nn.Module) -> Callable | None:
    """The model's own rotary application (q, k, cos, sin) -> (q, k), from the module that defines its attention."""
    return getattr(sys.modules[type(layer.self_attn).__module__], "apply_rotary_pos_emb", None)


class FastPathUnavailable(UserError):
    """A Llama-family model, which podsrl's own fast path exists for, cannot take that path."""


def check_fast_path(model: torch.nn.Module, component: str, reason: str | None, fallback_option: str) -> None:
    """Raises when `component` cannot drive a Llama-family model. For those models a quiet fallback would be a slow
    path nobody asked for (a transformers release that renamed an internal, an attention implementation podsrl
    does not handle): the user chooses the slower path explicitly with `fallback_option`. Other architectures may
    fall back; the caller logs and records it."""
    if reason is None or not is_llama_family(model):
        return
    kind = base_model(model).config.model_type
    raise FastPathUnavailable(
        f"{component} cannot drive this {kind} model with transformers {VERSION} (podsrl supports the range in its "
        f"pyproject.toml): {reason}. Set {fallback_option} to use the slower generic path explicitly"
    )
