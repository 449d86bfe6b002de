"""A config's memory plan: the model of podsrl/planning/ (which the engines stand on) applied to a podsrl config,
the workload the config means, the micro-batch `optim.micro_batch_size: auto` takes and the rows an engine keeps
through the update; and `podsrl plan CONFIG --memory`, its command line and table (or JSON). It reads a Config,
the methods and the tasks, so it stands above config/."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, replace
from pathlib import Path

from podsrl.config import load_config
from podsrl.config.facts import async_generator, keeps_decode_state, rows_in_flight
from podsrl.errors import UserError
from podsrl.methods import METHODS
from podsrl.models.precision import resolve_compute_dtype
from podsrl.planning.memory import (
    GIB,
    RESERVE,
    MemoryPlan,
    decode_state_fits,
    largest_micro_batch,
    make_plan,
    with_rows_in_flight,
)
from podsrl.planning.startup import describe_checkpoints, planned_checkpoint, streamed
from podsrl.planning.workload import (
    LINEAR_MODULES,
    MicroBatch,
    Workload,
    load_model_config,
    model_shape,
    parse_memory,
)
from podsrl.tasks import build_task, has_episodes
from podsrl.tasks.prompt_length import longest_prompt

ADVICE_LORA_RANK = 64  # the Qwen presets' rank, on all seven projections
ADVICE_WORLD_SIZES = (2, 4, 8)  # FSDP2 over one node's GPUs


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
        f"{'episode' if w.episodes else 'completion'} {w.completion_length} tokens; master {w.dtype}, compute {w.compute_dtype}; beta {w.beta}; "
        f"device {w.device}, {_gib(plan.memory)} GiB ({plan.reserve:.0%} kept free: {_gib(plan.budget)} GiB usable)",
        f"per rank of {w.world_size}: train.strategy={w.strategy}"
        + (" (one process: nothing sharded)" if w.strategy == "fsdp" and not w.sharded else "")
        + f"; a rank generates {w.rank_prompts} prompts' {w.rank_rows} rows and trains {w.trained_rows} rows a step "
        "(optim.micro_batch_size is per rank, rollout.prompts_per_step global)",
        host_line(plan)
        + (f"; train.cpu_offload keeps {_gib(plan.host['offloaded_state'])} GiB of sharded weights, gradients and "
           "AdamW state there (none on the device)" if w.offloaded else ""),
        *(["train.async: the update's rows include the next batch's generation, which runs meanwhile (its KV cache "
           "and workspace)"] if w.async_generator == "in_process" else []),
        "",
        "| phase | " + " | ".join(_TERMS) + " | peak GiB | fits | largest term |",
        "|---" * (len(_TERMS) + 4) + "|",
    ]
    gen = plan.generation
    lines.append(_row("start-up (models loaded, generation copy made)", plan.startup, plan.budget))
    lines.append(_row(f"generation ({w.generation_rows} of {w.rank_rows} rows at once)", gen, plan.budget))
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
                         f"{w.trained_rows} trained rows), or by tokens optim.micro_batch_tokens="
                         f"{plan.micro_batch_tokens(c)} (as many rows at full length; more when they are shorter)")
    for c in (False, True):
        if w.kept_decode_state:
            kept = "decode_state" in plan.update[c]
            lines.append(f"{'with' if c else 'without'} activation checkpointing: the fast engine's decode state (KV "
                         "cache, step state, CUDA graphs) is " + (
                             "kept through the update (decode_state): a step captures no graph an earlier step did"
                             if kept else "freed before each update (it does not fit beside the largest "
                             "micro-batch): each step captures its graphs anew"))
    if sum(gen.values()) > plan.budget:
        lines.append(f"generation does not fit even {w.generation_rows} row(s) at a time")
    elif w.generation_rows < w.rank_rows:
        lines.append(f"generation: the fast engine decodes {w.generation_rows} rows at a time, refilling finished "
                     "rows from the queue (its default rollout.engine_options.max_rows on this device)")
    return "\n".join(lines) + "\n"


def host_line(plan: MemoryPlan) -> str:
    """Host memory rank 0 loads the model through (podsrl/planning/startup.py host_load)."""
    s, w = plan.shape, plan.work
    if streamed(s, w):
        return (f"host memory: {_gib(plan.host['load'])} GiB on rank 0, which reads a safetensors checkpoint one "
                f"tensor at a time (the largest as stored, {s.stored_dtype}, and in {w.dtype}) and sends each rank "
                "its shards (any other checkpoint format: the whole model)")
    return (f"host memory: {_gib(plan.host['load'])} GiB to load the model in {w.dtype} before it is moved"
            + (" and sharded" if w.sharded else "")
            + (" (on rank 0 alone: the other ranks receive its tensors on their device)" if w.world_size > 1 else ""))


def update_flops(plan: MemoryPlan) -> float:
    """A step's matmul work on one rank, the cost the advice ranks settings by: 2 x parameters per token for a
    forward; the backward twice that with every weight trained, once (input gradients only; the adapters' share is
    small) with a frozen LoRA base; activation checkpointing one forward more. Generation: one forward per prompt
    and completion token of the rank's rows. Host-device traffic of train.cpu_offload is not timed here."""
    s, w = plan.shape, plan.work
    checkpointing = plan.micro_batch[False] == 0
    rows = plan.micro_batch[checkpointing]
    mb = MicroBatch.of(min(rows, w.trained_rows), w.m, w)
    tokens = math.ceil(w.trained_rows / rows) * mb.tokens
    passes = 1 + (1 if s.lora else 2) + (1 if checkpointing else 0)
    generated = w.rank_rows * w.completion_length + w.rank_prompts * w.prompt_length
    return 2.0 * s.params * (passes * tokens + generated)


def render_advice(options: list[tuple[list[str], MemoryPlan]], plan: MemoryPlan) -> str:
    """What to change when nothing fits: each setting that would, as overrides, cheapest step first."""
    if plan.fits:
        return ""
    if not options:
        return ("nothing fits, and neither LoRA, FSDP2 over up to 8 ranks nor train.cpu_offload would: lower "
                "rollout.max_new_tokens or the prompt length\n")
    cheapest = update_flops(options[0][1])
    lines = ["what would fit, cheapest predicted step first (matmul work per rank, relative to the first):"]
    for overrides, option in options:
        ckpt = option.micro_batch[False] == 0
        lines.append(f"  {update_flops(option) / cheapest:5.2f}x  {' '.join(overrides)} "
                     f"update.activation_checkpointing={str(ckpt).lower()} "
                     f"optim.micro_batch_size={option.micro_batch[ckpt]}")
    return "\n".join(lines) + "\n"


def advice(config, cfg, work: Workload, memory: int, reserve: float) -> list[tuple[list[str], MemoryPlan]]:
    """The settings that fit when the configured one does not, with their plans, ranked by update_flops (offload
    after an equal-cost setting without it: its host transfers are not counted): LoRA of rank 64 on the seven
    projections; FSDP2 over the world size given or the smallest of 2, 4, 8 ranks that fits; with train.cpu_offload."""
    candidates: list[tuple[list[str], object, Workload]] = []
    if cfg.model.lora_rank == 0:
        modules = ",".join(LINEAR_MODULES)
        candidates.append(([f"model.lora_rank={ADVICE_LORA_RANK}", f"model.lora_alpha={ADVICE_LORA_RANK}",
                            f"model.lora_target_modules=[{modules}]"],
                           model_shape(config, ADVICE_LORA_RANK, LINEAR_MODULES), work))
    shape = model_shape(config, cfg.model.lora_rank, cfg.model.lora_target_modules)
    sizes = (work.world_size,) if work.world_size > 1 else ADVICE_WORLD_SIZES
    for offload in (False, True):
        for n in sizes:
            sharded = replace(work, strategy="fsdp", world_size=n, cpu_offload=offload, rows_in_flight=0)
            if make_plan(shape, sharded, memory, reserve).fits or n == sizes[-1]:
                launch = [] if n == work.world_size else [f"torchrun --nproc_per_node {n}:"]
                candidates.append((launch + ["train.strategy=fsdp"] + (["train.cpu_offload=true"] if offload else []),
                                   shape, sharded))
                break
    plans = [(overrides, make_plan(s, w, memory, reserve)) for overrides, s, w in candidates]
    fitting = [(o, p) for o, p in plans if p.fits]
    return sorted(fitting, key=lambda item: (update_flops(item[1]), item[1].work.offloaded))


_TERMS = ("weights", "gradients", "optimizer", "reference", "engine_weights", "fused_weights", "generator_weights",
          "gathered", "kv_cache", "decode_state", "activations", "transient", "workspace", "runtime")


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
        "host_bytes": plan.host,
        "startup": plan.startup | {"peak": sum(plan.startup.values())},
        "reserve": plan.reserve,
        "generation": plan.generation | {"peak": sum(plan.generation.values())},
        "update": {("checkpointing" if c else "no_checkpointing"): plan.update[c] | {
            "peak": sum(plan.update[c].values()), "micro_batch_size": plan.micro_batch[c],
            "micro_batch_tokens": plan.micro_batch_tokens(c)} for c in (False, True)},
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
                       help="longest prompt in tokens (default: the config's task.max_prompt_length when set, else "
                       "the task's longest prompt tokenized by the model's tokenizer)")
    group.add_argument("--world-size", type=int, metavar="N",
                       help="torchrun ranks the plan is per rank of (default: the WORLD_SIZE environment variable "
                       "torchrun sets, else 1); with the config's train.strategy and train.cpu_offload")
    group.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                       help="how attention runs there (default cuda: scaled_dot_product_attention; cpu: matmuls "
                       "and a float32 softmax)")
    group.add_argument("--reserve", type=float, default=RESERVE,
                       help="share of the device kept free for what is not predicted: CUDA context, allocator "
                       "fragmentation, kernel workspaces (default 0.1, until a GPU run calibrates them)")


def workload_from_config(cfg, prompt_length: int, device: str, world_size: int = 1) -> Workload:
    """P, n, m, lengths and precision of a podsrl config (m: what the method trains of each prompt at most)."""
    m = METHODS[cfg.method].trained_per_prompt(cfg)
    compute = str(resolve_compute_dtype(cfg, device))
    episodes = has_episodes(cfg.task.name)  # a row holds a whole episode: up to episode.max_tokens
    return Workload(
        prompts=cfg.rollout.prompts_per_step, n=cfg.rollout.n, m=m, prompt_length=prompt_length,
        completion_length=cfg.episode.max_tokens if episodes else cfg.rollout.max_new_tokens, episodes=episodes,
        dtype=cfg.model.dtype, compute_dtype=compute.split(".")[-1],
        beta=cfg.algo.beta, logits_chunk=cfg.update.logits_chunk, top_p=cfg.rollout.top_p, device=device,
        async_generator=async_generator(cfg), rows_in_flight=rows_in_flight(cfg),
        kept_decode_state=keeps_decode_state(cfg, device),
        engine=cfg.rollout.engine_type.device_memory(cfg.rollout.engine_options),
        world_size=world_size, strategy=cfg.train.strategy, cpu_offload=cfg.train.cpu_offload,
    )


def kept_decode_rows(cfg, model_config, prompt_length: int, device: str, world_size: int, memory: int,
                     micro_batch: int) -> int:
    """A run's start-up decision for an engine that keeps a decode state between calls: the rows in flight the
    plan fits beside the update at the run's micro-batch (`micro_batch` rows: optim.micro_batch_size as the run
    decided it; update.activation_checkpointing) on a device of `memory` bytes (less the default reserve), which
    the engine then decodes at most; 0 where the state does not fit beside the update."""
    shape = model_shape(model_config, cfg.model.lora_rank, cfg.model.lora_target_modules)
    work = replace(workload_from_config(cfg, prompt_length, device, world_size), kept_decode_state=True)
    budget = int(memory * (1 - RESERVE))
    work = with_rows_in_flight(shape, work, budget)
    fits = decode_state_fits(shape, work, budget, micro_batch, cfg.update.activation_checkpointing)
    return work.generation_rows if fits else 0


AUTO_MICRO_BATCH_CPU = 256  # optim.micro_batch_size=0 off CUDA: the default's rows, so the run keeps its bits


def auto_micro_batch(cfg, model_config, prompt_length: int, device: str, world_size: int,
                     memory: int) -> tuple[int, str]:
    """optim.micro_batch_size=0 (auto): (rows, why). On CUDA the largest micro-batch the memory plan fits in `memory`
    bytes less the default reserve (as `podsrl plan --memory` advises it, at update.activation_checkpointing), at
    most a rank's mini-batch, so where the plan fits the mini-batch the update runs one micro-batch; elsewhere there
    is no device memory to plan against and it is AUTO_MICRO_BATCH_CPU rows."""
    if device != "cuda":
        return AUTO_MICRO_BATCH_CPU, f"the {device} has no device memory to plan against"
    shape = model_shape(model_config, cfg.model.lora_rank, cfg.model.lora_target_modules)
    work = replace(workload_from_config(cfg, prompt_length, device, world_size), kept_decode_state=False)
    budget = int(memory * (1 - RESERVE))
    work = with_rows_in_flight(shape, work, budget)
    checkpointing = cfg.update.activation_checkpointing
    mini = -(-work.trained_rows // cfg.optim.mini_batches)
    rows = min(largest_micro_batch(shape, work, budget, checkpointing), mini)
    where = (f"in {_gib(budget)} GiB of this device's {_gib(memory)} GiB (update.activation_checkpointing="
             f"{str(checkpointing).lower()})")
    if rows == 0:
        return 1, f"the memory plan fits not even one row {where}: the update may run out of memory"
    if rows == mini:
        return rows, f"the memory plan fits a rank's whole mini-batch ({mini} rows) {where}: one micro-batch"
    return rows, f"the largest micro-batch the memory plan fits {where}, of a {mini}-row mini-batch"


def configured_micro_batch(cfg, model_config, prompt_length: int, device: str, world_size: int, memory: int) -> str:
    """The config's optim.micro_batch_size as a run on this device takes it: set, or what auto decides at start-up
    (at the default reserve, as the run plans)."""
    if cfg.optim.micro_batch_size > 0:
        return f"this config: optim.micro_batch_size={cfg.optim.micro_batch_size} (set)"
    rows, why = auto_micro_batch(cfg, model_config, prompt_length, device, world_size, memory)
    return f"this config: optim.micro_batch_size=auto -> {rows} rows per micro-batch on each rank at start-up: {why}"


def transformers_config(cfg, model: str):
    """The transformers config of `model` ('tiny': the built-in model as the config sizes it)."""
    if model == "tiny":
        import torch

        from podsrl.models.loading import build_char_tokenizer, build_tiny_model

        with torch.device("meta"):
            return build_tiny_model(cfg.model.tiny, build_char_tokenizer()).config
    return load_model_config(model)


def shape_from_config(cfg, model: str):
    return model_shape(transformers_config(cfg, model), cfg.model.lora_rank, cfg.model.lora_target_modules)


def prompt_length_from_data(cfg, model: str) -> int:
    """The longest prompt of the task's problems in tokens of the model's tokenizer (loaded from `model` locally,
    nothing downloaded): what the plan sizes when task.max_prompt_length is unset."""
    hint = "set task.max_prompt_length or --prompt-length"
    if model == "tiny":
        from podsrl.models.loading import build_char_tokenizer

        tokenizer = build_char_tokenizer()
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(f"task.max_prompt_length is unset and the tokenizer of {model!r} is not local, so the "
                            f"longest prompt cannot be counted: {hint} ({str(e).strip().splitlines()[0]})") from None
    try:
        task = build_task(cfg.task, tokenizer)
    except (OSError, UserError) as e:
        raise UserError(f"task.max_prompt_length is unset and the task's data cannot be read, so the longest "
                        f"prompt cannot be counted: {hint} ({str(e).strip().splitlines()[0]})") from None
    return longest_prompt(task, tokenizer)


def world_size_default() -> int:
    """torchrun's WORLD_SIZE when the plan runs under it (or the user exported it), else 1."""
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"WORLD_SIZE={value!r} in the environment is not a number of ranks (or pass --world-size)")
    return int(value)


def memory_main(args, config: Path) -> int:
    if not args.gpu_memory:
        raise UserError("--memory needs --gpu-memory SIZE (e.g. 80GiB): the memory to fit in")
    memory = parse_memory(args.gpu_memory)
    if not 0 <= args.reserve < 1:
        raise UserError(f"--reserve: {args.reserve} is not a share in [0, 1)")
    world_size = args.world_size if args.world_size is not None else world_size_default()
    if world_size < 1:
        raise UserError(f"--world-size: {world_size} is not a number of ranks (1 or more)")
    if args.prompt_length is not None and args.prompt_length < 1:
        raise UserError(f"--prompt-length: {args.prompt_length} is not a number of tokens (1 or more)")
    cfg = load_config(config, args.overrides)
    model = args.model or cfg.model.name_or_path
    prompt_length = args.prompt_length or cfg.task.max_prompt_length or prompt_length_from_data(cfg, model)
    config_obj = transformers_config(cfg, model)
    shape = model_shape(config_obj, cfg.model.lora_rank, cfg.model.lora_target_modules)
    work = workload_from_config(cfg, prompt_length, args.device, world_size)
    plan = make_plan(shape, work, memory, args.reserve)
    print(render(plan, model), end="")
    print(configured_micro_batch(cfg, config_obj, prompt_length, args.device, world_size, memory))
    print(describe_checkpoints(planned_checkpoint(shape, work), cfg.train.keep_checkpoints, work.sharded))
    if not plan.fits:
        print(render_advice(advice(config_obj, cfg, work, memory, args.reserve), plan), end="")
    if args.json:
        Path(args.json).write_text(dumps(plan), encoding="utf-8")
    return 0
