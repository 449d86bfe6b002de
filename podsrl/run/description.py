"""The start-up lines that say where and how a run trains and what each checkpoint will write, and the note on a
resume at another world size."""

from __future__ import annotations

import hashlib
import json

import torch

from podsrl.models.transformers_api import has_adapters
from podsrl.planning.startup import checkpoint_size, describe_checkpoints


def describe_run(cfg, facts, ctx, model: torch.nn.Module, engine: str) -> str:
    """Devices, world size, strategy, master and compute dtypes, what trains (LoRA's rank, modules and trainable
    parameters, or the full model) and the rollout engine, in one line. `model` is unsharded (the generation copy
    under FSDP2), so its counts are the whole model's."""
    if ctx.world_size > 1:
        where = (f"{ctx.world_size} ranks (torchrun, {'nccl' if ctx.device.type == 'cuda' else 'gloo'}) on "
                 f"{ctx.device.type}{', each on cuda:LOCAL_RANK' if ctx.device.type == 'cuda' else ''}, "
                 f"train.strategy={cfg.train.strategy}")
    else:
        where = f"one process on {ctx.device}"
    master, compute = (str(d).removeprefix("torch.") for d in (facts.master_dtype, facts.compute_dtype))
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cfg.model.lora_rank > 0:
        what = (f"LoRA rank {cfg.model.lora_rank} on {','.join(cfg.model.lora_target_modules)}: "
                f"{_count(trained)} trainable (float32) of {_count(total)} parameters")
    else:
        what = f"full fine-tune: {_count(trained)} trainable parameters"
    return f"run: {where}; master {master}, compute {compute}; {what}; engine {engine}"


def describe_checkpoint_size(cfg, model: torch.nn.Module, generation_model: torch.nn.Module, sharded: bool) -> str:
    """What each checkpoint writes (podsrl/planning/startup.py checkpoint_size), counted on the run's own tensors:
    model/ is `generation_model` saved (a LoRA adapter alone), the training state AdamW's moments of `model`'s
    trained parameters and under FSDP2 its master weights (a sharded parameter counts whole)."""
    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    exported = [p for p in generation_model.parameters() if p.requires_grad or not has_adapters(generation_model)]
    size = checkpoint_size(nbytes(exported), nbytes(model.parameters()),
                           nbytes(p for p in model.parameters() if p.requires_grad), sharded)
    return describe_checkpoints(size, cfg.train.keep_checkpoints, sharded)


def world_size_change(written: int, now: int) -> str:
    """What a resume on `now` ranks of a checkpoint written by `written` changes."""
    return (f"resuming a checkpoint written by {written} rank(s) on {now}: each rank now generates and trains "
            f"1/{now} of a step's prompts and rows, so a rank's memory changes (optim.micro_batch_size is per rank; "
            f"`podsrl plan --memory --world-size {now}` sizes it); rollout.prompts_per_step is global, so the step's "
            "batch and its summed gradients are the same (with the fast engine's per-row seeds, the rollouts too)")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def tokenizer_identity(tokenizer, name_or_path: str) -> dict:
    """What a run's token counts count (summary.json's "tokenizer"; `podsrl compare` sets runs side by side only
    where these agree): the tokenizer's class and source, its vocabulary size and a digest of its vocabulary
    (token -> id), equal exactly when two runs' tokens are the same."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()
    return {"name": f"{type(tokenizer).__name__} of {name_or_path}", "vocab_size": len(tokenizer),
            "digest": hashlib.sha256(vocab).hexdigest()[:12]}
