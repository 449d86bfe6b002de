"""Rollout engines: where completions are sampled. All sit behind `RolloutEngine` (see base.py); this registry maps a
`rollout.engine` name to its class and imports a backend only when it is asked for, so optional extras (Ray, vLLM)
stay optional and base.py imports none of them. It is the one list of engine names: the config's choices for
`rollout.engine` and its default come from here, and the code outside engines/ reads an engine's traits (base.py)
from its class, never its name."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from podsrl.engines.base import GenerationOutput, RolloutEngine, SamplingParams
from podsrl.errors import ConfigError

# name -> "module:class", imported on first use
ENGINES: dict[str, str] = {
    "fast": "podsrl.engines.fast:FastEngine",
    "hf": "podsrl.engines.hf:HFEngine",
    "ray": "podsrl.engines.ray:RayEngine",
    "vllm": "podsrl.engines.vllm:VLLMEngine",
}
DEFAULT_ENGINE = "fast"
# Read by every engine from its options (podsrl.engines.rows.special_ids), beside its own keyword arguments.
SPECIAL_ID_OPTIONS = ("eos_token_id", "pad_token_id")


def engine_class(name: str) -> type[RolloutEngine]:
    if name not in ENGINES:
        raise ConfigError(f"rollout.engine: unknown engine {name!r} (choose from {', '.join(ENGINES)})")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def engine_options(name: str) -> list[str]:
    """The option names the engine `name` accepts in rollout.engine_options."""
    params = inspect.signature(engine_class(name).__init__).parameters.values()
    own = [p.name for p in params if p.kind is p.KEYWORD_ONLY or (
        p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in ("self", "model", "tokenizer"))]
    return own + list(SPECIAL_ID_OPTIONS)


def engine_option_default(name: str, option: str) -> Any:
    """The default of one of the engine `name`'s options (its keyword's default)."""
    return inspect.signature(engine_class(name).__init__).parameters[option].default


def check_engine_options(name: str, options: dict[str, Any], key: str = "rollout.engine_options") -> None:
    """ConfigError naming the first option `name` does not take (a misspelling would otherwise be ignored)."""
    known = engine_options(name)
    for option in options:
        if option not in known:
            raise ConfigError(f"{key}.{option}: not an option of the {name!r} engine (it takes: {', '.join(known)})")
    inner = engine_class(name).worker_engine(options)
    if inner is not None:  # the engine its workers run gets its own options
        inner_name, inner_options, inner_key = inner
        check_engine_options(inner_name, inner_options, f"{key}.{inner_key}")


def build_engine(name: str, model: torch.nn.Module, tokenizer, **options) -> RolloutEngine:
    """The engine `name` over `model`, after checking its options."""
    check_engine_options(name, options)
    return engine_class(name)(model, tokenizer, **options)


__all__ = ["DEFAULT_ENGINE", "ENGINES", "GenerationOutput", "RolloutEngine", "SamplingParams", "build_engine",
           "check_engine_options", "engine_class", "engine_option_default", "engine_options"]
