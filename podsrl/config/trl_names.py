"""TRL's `GRPOConfig` names next to podsrl's: the migration table of docs/trl.md (generated from `ROWS`, with both
sides' defaults), and the TRL names a podsrl config accepts where the meaning is the same.

TRL defaults are stated as TRL declares them; tests/integrations/test_trl_table.py checks every row against the installed
`GRPOConfig`, and podsrl's defaults are read from podsrl/config/sections.py, so neither side can go stale silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from podsrl.errors import ConfigError


@dataclass(frozen=True)
class Row:
    trl: str  # the GRPOConfig field
    trl_default: Any  # its declared default
    podsrl: tuple[str, ...]  # podsrl keys (empty: no counterpart)
    note: str  # same or not, and what to do
    accepted: bool = False  # podsrl takes the TRL name in a config, meaning the same
    values: dict[Any, Any] | None = None  # TRL value -> podsrl value, where the spelling differs
    fills: tuple[str, ...] = field(default=())  # further keys set when the user has not set them
    refusal: str = ""  # a row without podsrl keys: what to do instead of a TRL value podsrl does not take


ROWS: tuple[Row, ...] = (
    Row("learning_rate", 1e-6, ("optim.lr",), "**differs**: podsrl's default is tuned for the built-in 0.8M model; "
        "the Qwen presets set 5e-6 / 1e-5 for LoRA", accepted=True),
    Row("max_completion_length", 512, ("rollout.max_new_tokens",), "**differs**: the built-in task's answers are a "
        "few characters; the Qwen presets set 512 / 1024", accepted=True),
    Row("num_generations", 8, ("rollout.n",), "**differs**; with `method: pods`, `pods.m` of the n are trained",
        accepted=True),
    Row("bf16", None, ("model.compute_dtype",), "same on CUDA: TRL resolves `None` to bf16 mixed precision "
        "(float32 master weights, bf16 compute) unless `fp16`, podsrl's `auto` to bfloat16 compute over float32 "
        "`model.dtype` (float32 on CPU); `true`/`false` = `bfloat16`/`float32`. `model.dtype: bfloat16` is pure "
        "bfloat16 (no float32 copy); `fp16` has no counterpart (no loss scaling)", accepted=True,
        values={None: "auto", True: "bfloat16", False: "float32"}),
    Row("gradient_checkpointing", True, ("update.activation_checkpointing",), "**differs**: on in TRL, off in "
        "podsrl (its default models fit without it; it costs about one more forward); the same per-layer "
        "non-reentrant recomputation", accepted=True),
    Row("use_vllm", False, ("rollout.engine",), "same: `true` = the `vllm` engine (colocated, next row), `false` = "
        "`hf` (transformers' `generate`, what TRL uses without vLLM); podsrl's default `fast` engine is its own",
        accepted=True, values={True: "vllm", False: "hf"}),
    Row("vllm_mode", "colocate", (), "same for `colocate`: podsrl's `vllm` engine runs in the trainer's process, on "
        "its GPU; `server` (a separate `trl vllm-serve` process) has no counterpart", accepted=True,
        values={"colocate": None}, refusal="set rollout.engine=vllm, which runs vLLM colocated with the trainer"),
    Row("vllm_gpu_memory_utilization", 0.3, ("rollout.engine_options.gpu_memory_utilization",), "**differs**: "
        "the share of the GPU's memory vLLM may take (weights, activations, CUDA graphs and KV cache; `None` = 0.4), "
        "an option of the `vllm` engine (refused by the others, and on vLLM's CPU build, whose KV cache "
        "`kv_cache_gib` sizes)", accepted=True),
    Row("vllm_importance_sampling_correction", True, ("algo.rollout_correction",), "**differs** in where it "
        "applies: TRL corrects vLLM-sampled rollouts; podsrl's `auto` corrects with TRL's default mode for the "
        "vllm engine and asynchronous generation from older weights, with `token_tis` for a precision-only "
        "mismatch (a compute dtype other than `model.dtype`), and not when the `fast`/`hf`/`ray` engine samples "
        "with the trained module in one precision; `none` turns it off"),
    Row("vllm_importance_sampling_mode", "sequence_mask", ("algo.rollout_correction",), "same formulas, applied to "
        "any engine's rollouts (`token_truncate` = `token_tis`, `sequence_truncate` = `sequence_tis`)",
        accepted=True, values={"token_truncate": "token_tis", "token_mask": "token_mask",
                               "sequence_truncate": "sequence_tis", "sequence_mask": "sequence_mask"}),
    Row("vllm_importance_sampling_clip_max", 3.0, ("algo.rollout_correction_cap",), "same", accepted=True),
    Row("vllm_importance_sampling_clip_min", None, ("algo.rollout_correction_cap_low",), "same (TRL's `None` = "
        "podsrl's 0: no lower bound)", accepted=True),
    Row("lr_scheduler_type", "linear", ("optim.scheduler",), "**differs**: podsrl has `constant` and `cosine` "
        "(no `linear`)", accepted=True, values={"constant": "constant", "cosine": "cosine"}),
    Row("warmup_steps", 0, ("optim.warmup_steps",), "same", accepted=True),
    Row("per_device_train_batch_size", 8, ("rollout.prompts_per_step",), "**different vocabulary**: TRL counts "
        "completions per device and micro-step (`num_generations` of them per prompt); podsrl counts prompts per "
        "step P, each with `rollout.n` rollouts, P·n generated a step"),
    Row("gradient_accumulation_steps", 1, ("optim.micro_batch_size",), "**different vocabulary**: in TRL it "
        "multiplies the completions per optimiser step; in podsrl an optimiser step takes the step's trained "
        "rollouts / `optim.mini_batches`, run in micro-batches of `optim.micro_batch_size` (memory only)"),
    Row("steps_per_generation", None, ("optim.mini_batches",), "**different vocabulary**: optimiser steps per "
        "generated batch (TRL's `None` = `gradient_accumulation_steps`); podsrl splits the step's batch into this "
        "many mini-batches"),
    Row("mask_truncated_completions", False, (), "same behaviour by default: podsrl trains on truncated completions "
        "(with their reward) and has no switch to mask them"),
    Row("loss_type", "dapo", ("algo.loss_agg",), "same (`dapo` = `token_mean`; `grpo` = `seq_mean_token_mean`, "
        "`dr_grpo` = `seq_mean_token_sum_norm`)", accepted=True,
        values={"dapo": "token_mean", "grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm"}),
    Row("scale_rewards", "group", ("algo.scale",), "same (`group`, `batch`, `none`; TRL's `true`/`false` = "
        "`group`/`none`)", accepted=True,
        values={"group": "group", "batch": "batch", "none": "none", True: "group", False: "none"}),
    Row("epsilon", 0.2, ("algo.epsilon_low",), "same; as in TRL, it also sets the upper clip unless `epsilon_high` "
        "is given", accepted=True, fills=("algo.epsilon_high",)),
    Row("epsilon_high", None, ("algo.epsilon_high",), "same (TRL's `None` = `epsilon`)", accepted=True),
    Row("beta", 0.0, ("algo.beta",), "same coefficient of the same k3 estimator (0 loads no reference model); "
        "TRL also multiplies the KL term by the PPO ratio unless `use_bias_correction_kl` is false (next row)",
        accepted=True),
    Row("use_bias_correction_kl", True, ("algo.kl_ratio_weighted",), "**differs**: on in TRL, off in podsrl; "
        "the same product (the KL term times the ratio, not detached: it changes the gradient even on one pass)",
        accepted=True),
    Row("num_iterations", 1, ("optim.epochs",), "same", accepted=True),
    Row("temperature", 1.0, ("rollout.temperature",), "same", accepted=True),
    Row("top_p", 1.0, ("rollout.top_p",), "same", accepted=True),
    Row("top_k", 0, ("rollout.top_k",), "same (0 = off)", accepted=True),
    Row("max_grad_norm", 1.0, ("optim.max_grad_norm",), "same", accepted=True),
    Row("weight_decay", 0.0, ("optim.weight_decay",), "same", accepted=True),
    Row("max_steps", -1, ("train.max_steps",), "**differs**: TRL's -1 means `num_train_epochs`; podsrl counts "
        "steps only", accepted=True),
    Row("seed", 42, ("seed",), "**differs**", accepted=True),
    Row("save_steps", 500, ("train.save_every",), "**differs**", accepted=True),
    Row("eval_steps", None, ("train.eval_every",), "**differs**: TRL's `None` = `logging_steps`", accepted=True),
    Row("report_to", "none", ("log.report_to",), "**differs**; the same values (`tensorboard`, `wandb`, "
        "`trackio`, `all`, `none`)", accepted=True),
    Row("run_name", None, ("log.run_name",), "same meaning; podsrl's default is the config name and seed",
        accepted=True),
)

ACCEPTED = {row.trl: row for row in ROWS if row.accepted and row.podsrl != (row.trl,)}  # seed: the same key


def _get(tree: dict, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
    tree[last] = value


def _translate(tree: dict) -> list[tuple[str, Any]]:
    """Move the TRL names of one source (the config file, or the command line) to their podsrl keys in place; a
    TRL name and its podsrl key both in this source is an error. Returns the keys a name fills where unset."""
    for name in tree:
        row = next((r for r in ROWS if r.trl == name and not r.accepted), None)
        if row is not None:
            instead = f"set {', '.join(row.podsrl)}" if row.podsrl else "podsrl has no counterpart"
            raise ConfigError(f"{name}: TRL's name, not taken by podsrl since the meaning differs; {instead} "
                              "(docs/trl.md has the table)")
    given = [name for name in tree if name in ACCEPTED]
    filled = []
    for name in given:
        row, value = ACCEPTED[name], tree.pop(name)
        if row.values is not None:
            if value not in row.values:
                instead = row.refusal or f"set {row.podsrl[0]}"
                raise ConfigError(f"{name}: {value!r} has no podsrl counterpart; use one of "
                                  f"{', '.join(map(str, row.values))} (or {instead})")
            value = row.values[value]
        for key in row.podsrl:
            if _get(tree, key) is not None:
                raise ConfigError(f"{name}: TRL's name for {key}, which is also set; give one of them")
            _set(tree, key, value)
        filled += [(key, value) for key in row.fills]
    return filled


def _merge(base: dict, over: dict) -> dict:
    """`over`'s keys win, section by section."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def translate_trl_names(*sources: dict) -> dict:
    """Move top-level TRL names (`num_generations: 8`, `learning_rate=1e-6` on the command line) to their podsrl
    keys and merge the sources, later ones winning: a TRL name on the command line overrides the podsrl key a
    config file (a preset) sets. Within one source, a TRL name and its podsrl key both given, a TRL value with no
    podsrl counterpart, or a TRL name whose meaning differs (`per_device_train_batch_size`) is a ConfigError
    saying what to set instead."""
    tree: dict = {}
    filled = []
    for source in sources:
        filled += _translate(source)
        _merge(tree, source)
    for key, value in filled:  # e.g. `epsilon` sets the upper clip too, unless any source set it
        if _get(tree, key) is None:
            _set(tree, key, value)
    return tree
