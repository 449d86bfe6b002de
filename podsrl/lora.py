"""LoRA adapters through peft: wrap a causal LM, save/load just the adapter, export merged full weights.

With LoRA only the adapter matrices train, so the optimiser should be built from
`[p for p in model.parameters() if p.requires_grad]` after `apply_lora`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from podsrl.errors import ConfigError, UserError
from podsrl.extras import require


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def apply_lora(
    model: torch.nn.Module,
    rank: int = 16,
    alpha: float = 32.0,
    dropout: float = 0.0,
    target_modules: list[str] | str = "all-linear",
) -> Any:
    """The model wrapped as a peft PeftModel with fresh LoRA adapters; base weights are frozen.

    target_modules: module names (e.g. ["q_proj", "v_proj"]) or "all-linear" (every linear layer except the
    output head). Unknown names raise ConfigError listing the model's linear layers.
    """
    require("peft", "LoRA (model.lora_rank > 0)")
    from peft import LoraConfig, TaskType, get_peft_model

    if rank < 1:
        raise ConfigError(f"model.lora_rank must be >= 1, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"model.lora_dropout must be in [0, 1), got {dropout}")
    if target_modules != "all-linear":
        if isinstance(target_modules, str):
            target_modules = [target_modules]
        missing = sorted(set(target_modules) - _linear_names(model))
        if missing:
            raise ConfigError(f"model.lora_target_modules: {missing} are not linear layers of this model "
                              f"(it has {sorted(_linear_names(model))})")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        task_type=TaskType.CAUSAL_LM, bias="none")
    return get_peft_model(model, config)


def save_adapter(model: Any, path: str | Path) -> None:
    """Only the adapter weights and config (adapter_model.safetensors + adapter_config.json)."""
    model.save_pretrained(str(path), safe_serialization=True)


def load_adapter(base_model: torch.nn.Module, path: str | Path, trainable: bool = False) -> Any:
    """`base_model` with the adapter saved at `path` (trainable=True to continue training it)."""
    require("peft", f"loading the LoRA adapter {path}")
    from peft import PeftModel

    if not (Path(path) / "adapter_config.json").is_file():
        raise UserError(f"{path}: no adapter_config.json, not a saved LoRA adapter")
    return PeftModel.from_pretrained(base_model, str(path), is_trainable=trainable)


@torch.no_grad()
def merged_weights(model: Any, device: str | torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each entry of the base model's state dict under its plain name (as the model has without
    peft: no adapter matrices, no `.base_layer`, a module to save under its own name), each adapted weight W + delta
    made one at a time (on `device`; None: beside W) without merging in place: merge/unmerge would round the base
    weights in low precision on every call."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {f"{name}.base_layer.weight": module for name, module in base.named_modules()
               if isinstance(module, LoraLayer)}
    for key, value in base.state_dict().items():
        if ".lora_" in key or ".original_module." in key:
            continue
        module = adapted.get(key)
        if module is not None:
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            value = (value.detach().float() + delta.float()).to(value.dtype)
            value = value if device is None else value.to(device)
        yield re.sub(r"\.modules_to_save\.[^.]+\.", ".", key.replace(".base_layer.", ".")), value


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapted weight replaced by W + delta (those on CPU)."""
    return dict(merged_weights(model, device="cpu"))


@torch.no_grad()
def export_merged(model: Any, path: str | Path, tokenizer: Any = None) -> None:
    """Full merged weights (base + adapter) as a plain transformers checkpoint in safetensors, loadable with
    AutoModelForCausalLM.from_pretrained(path) without peft. `model` itself is left unchanged."""
    base = model.get_base_model()
    base.save_pretrained(str(path), state_dict=merged_state_dict(model), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
