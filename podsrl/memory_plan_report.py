"""`podsrl plan CONFIG --memory`: the command line and the table (or JSON) of the memory plan that
podsrl/memory_plan.py predicts."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from podsrl.errors import UserError
from podsrl.memory_plan import (
    GIB,
    RESERVE,
    MemoryPlan,
    Workload,
    load_model_config,
    make_plan,
    model_shape,
    parse_memory,
)


def _gib(x: int) -> str:
    return f"{x / GIB:.3f}"


def dominant(terms: dict[str, int]) -> str:
    name = max(terms, key=terms.get)
    return f"{name} ({terms[name] / max(1, sum(terms.values())):.0%})"


def render(plan: MemoryPlan, model: str) -> str:
    s, w = plan.shape, plan.work
    lines = [
        f"podsrl plan --memory {model}: {s.model_type}, {s.params / 1e6:.1f}M parameters "
        f"({s.trained_params / 1e6:.1f}M trained{', LoRA' if s.lora else ''}), {s.layers} layers, hidden {s.hidden}, "
        f"heads {s.heads}/{s.kv_heads} x {s.head_dim}, vocabulary {s.vocab}",
        f"step: {w.prompts} prompts x {w.n} generated, {w.m} trained per prompt; prompt {w.prompt_length} + "
        f"completion {w.completion_length} tokens; master {w.dtype}, compute {w.compute_dtype}; beta {w.beta}; "
        f"device {w.device}, {_gib(plan.memory)} GiB ({plan.reserve:.0%} kept free: {_gib(plan.budget)} GiB usable)",
        *(["train.async: the update's rows include the next batch's generation, which runs meanwhile (its KV cache "
           "and workspace)"] if w.async_generator == "in_process" else []),
        "",
        "| phase | " + " | ".join(_TERMS) + " | peak GiB | fits | largest term |",
        "|---" * (len(_TERMS) + 4) + "|",
    ]
    gen = plan.generation
    lines.append(_row(f"generation ({w.generation_rows} of {w.prompts * w.n} rows at once)", gen, plan.budget))
    for c in (False, True):
        rows = plan.micro_batch[c]
        label = f"update, {'' if c else 'no '}checkpointing, micro-batch {max(rows, 1)}"
        lines.append(_row(label, plan.update[c], plan.budget))
    lines.append("")
    for c in (False, True):
        rows = plan.micro_batch[c]
        how = "with" if c else "without"
        if rows == 0:
            lines.append(f"{how} activation checkpointing: not even a micro-batch of 1 row fits")
        else:
            count = math.ceil(w.trained_rows / rows)
            lines.append(f"{how} activation checkpointing: update.activation_checkpointing={str(c).lower()} "
                         f"optim.micro_batch_size={rows} ({count} micro-batch{'es' if count > 1 else ''} for "
                         f"{w.trained_rows} trained rows)")
    if sum(gen.values()) > plan.budget:
        lines.append(f"generation does not fit even {w.generation_rows} row(s) at a time: lower the lengths")
    elif w.generation_rows < w.prompts * w.n:
        lines.append(f"generation: the fast engine decodes {w.generation_rows} rows at a time, refilling finished "
                     "rows from the queue (its default rollout.engine_options.max_rows on this device)")
    return "\n".join(lines) + "\n"


_TERMS = ("weights", "gradients", "optimizer", "reference", "engine_weights", "fused_weights", "generator_weights",
          "kv_cache", "activations", "transient", "workspace", "runtime")


def _row(label: str, terms: dict[str, int], budget: int) -> str:
    cells = [_gib(terms[t]) if t in terms else "—" for t in _TERMS]
    total = sum(terms.values())
    return f"| {label} | " + " | ".join(cells) + f" | {_gib(total)} | {'yes' if total <= budget else 'NO'} | " \
        f"{dominant(terms)} |"


def to_json(plan: MemoryPlan) -> dict:
    return {
        "shape": asdict(plan.shape),
        "workload": asdict(plan.work),
        "memory_bytes": plan.memory,
        "reserve": plan.reserve,
        "generation": plan.generation | {"peak": sum(plan.generation.values())},
        "update": {("checkpointing" if c else "no_checkpointing"): plan.update[c] | {
            "peak": sum(plan.update[c].values()), "micro_batch_size": plan.micro_batch[c]} for c in (False, True)},
    }


def dumps(plan: MemoryPlan) -> str:
    return json.dumps(to_json(plan), indent=1)


# ---- the command line: `podsrl plan CONFIG --memory ...` ----


def add_memory_arguments(parser) -> None:
    group = parser.add_argument_group("memory plan (--memory): predicted peaks from the config, nothing is run")
    group.add_argument("--memory", action="store_true",
                       help="predict the peak memory of generation and of the update instead of measuring step "
                       "times: P, n, m, completion length, dtype, LoRA rank, beta and logits chunk from the config")
    group.add_argument("--gpu-memory", metavar="SIZE", help="the device's memory, e.g. 80GiB, 24GB (with --memory)")
    group.add_argument("--model", metavar="NAME_OR_PATH",
                       help="hub id (config in the local Hugging Face cache), model directory or config.json "
                       "(default: the config's model.name_or_path)")
    group.add_argument("--prompt-length", type=int, metavar="TOKENS",
                       help="longest prompt in tokens (default: the config's task.max_prompt_length when set)")
    group.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                       help="how attention runs there (default cuda: scaled_dot_product_attention; cpu: matmuls "
                       "and a float32 softmax)")
    group.add_argument("--reserve", type=float, default=RESERVE,
                       help="share of the device kept free for what is not predicted: CUDA context, allocator "
                       "fragmentation, kernel workspaces (default 0.1, until a GPU run calibrates them)")


def workload_from_config(cfg, prompt_length: int, device: str) -> Workload:
    """P, n, m, lengths and precision of a podsrl config (m: what the method trains of each prompt at most)."""

    from podsrl.methods import METHODS
    from podsrl.models.precision import resolve_compute_dtype

    m = METHODS[cfg.method].trained_per_prompt(cfg)
    compute = str(resolve_compute_dtype(cfg, device))
    return Workload(
        prompts=cfg.rollout.prompts_per_step, n=cfg.rollout.n, m=m, prompt_length=prompt_length,
        completion_length=cfg.rollout.max_new_tokens, dtype=cfg.model.dtype, compute_dtype=compute.split(".")[-1],
        beta=cfg.algo.beta, logits_chunk=cfg.update.logits_chunk, top_p=cfg.rollout.top_p, device=device,
        async_generator=("none" if not cfg.train.asynchronous.enabled
                         else "ray" if cfg.rollout.engine == "ray" else "in_process"),
        rows_in_flight=int(cfg.rollout.engine_options.get("max_rows") or 0),  # 0: what the device holds
    )


def shape_from_config(cfg, model: str):
    """(shape, label) of `model` ('tiny': the built-in model as the config sizes it)."""
    if model == "tiny":
        import torch

        from podsrl.models.loading import build_char_tokenizer, build_tiny_model

        with torch.device("meta"):
            config = build_tiny_model(cfg.model.tiny, build_char_tokenizer()).config
    else:
        config = load_model_config(model)
    return model_shape(config, cfg.model.lora_rank, cfg.model.lora_target_modules)


def memory_main(args, config: Path) -> int:
    from podsrl.config import load_config

    if not args.gpu_memory:
        raise UserError("--memory needs --gpu-memory SIZE (e.g. 80GiB): the memory to fit in")
    memory = parse_memory(args.gpu_memory)
    if not 0 <= args.reserve < 1:
        raise UserError(f"--reserve: {args.reserve} is not a share in [0, 1)")
    cfg = load_config(config, args.overrides)
    prompt_length = args.prompt_length or cfg.task.max_prompt_length
    if prompt_length < 1:
        raise UserError("--prompt-length: give the longest prompt in tokens (the config's task.max_prompt_length "
                        "is 0, i.e. unset)")
    model = args.model or cfg.model.name_or_path
    shape = shape_from_config(cfg, model)
    plan = make_plan(shape, workload_from_config(cfg, prompt_length, args.device), memory, args.reserve)
    print(render(plan, model), end="")
    if args.json:
        Path(args.json).write_text(dumps(plan), encoding="utf-8")
    return 0
