"""The policy, prompts and engines of the real-vLLM tests (conftest.py says what runs here)."""

from __future__ import annotations

import torch
from transformers import Qwen2ForCausalLM

from podsrl.run.warmup import SHIPPED
from podsrl.tasks.arithmetic import ArithmeticTask

SKIP_REASON = ("vLLM is not installed here: these tests run in the environment of README.md's 'vLLM on the CPU' "
               "line (CI's vllm lane, .ci/run)")
WARMUP = next(p for p in sorted(SHIPPED.iterdir()) if (p / "config.json").is_file())
VLLM_OPTIONS = {"enforce_eager": True, "kv_cache_gib": 0.25}


def load_policy() -> Qwen2ForCausalLM:
    """A fresh float32 copy of the built-in model at the shipped warm-up."""
    return Qwen2ForCausalLM.from_pretrained(WARMUP, dtype=torch.float32).eval()


def task_prompts(tokenizer, count: int, offset: int = 0) -> list[list[int]]:
    """Token ids of `count` held-out prompts of the built-in task."""
    problems = ArithmeticTask(seed=0).eval_set()[offset : offset + count]
    return [tokenizer(p.prompt, add_special_tokens=False).input_ids for p in problems]


def vllm_engine(model, tokenizer, **options):
    from podsrl.engines.vllm import VLLMEngine

    return VLLMEngine(model, tokenizer, **{**VLLM_OPTIONS, **options})


def fast_engine(model, tokenizer):
    from podsrl.engines.fast import FastEngine

    return FastEngine(model, tokenizer)


def completions(out) -> list[list[int]]:
    """Each row's tokens up to and including its first stop (the mask), as lists."""
    return [ids[: int(mask.sum())] for ids, mask in zip(out.completion_ids.tolist(), out.completion_mask)]
