"""The fast engine's rows in flight on a CUDA device (podsrl/engines/device_rows.py), with CUDA's memory calls mocked:
a state the trainer keeps through the update is sized by the run's memory plan, not by the free memory of the first
generate call (before the optimiser's state and the gradients exist), and the CUDA graphs' private pool is not
counted as free memory."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

from podsrl.config import load_config
from podsrl.engines import fast
from podsrl.engines.decode_step import Buckets
from podsrl.memory_plan import workload_from_config
from podsrl.planning import memory as mp
from podsrl.planning import workload as mw
from podsrl.run import engine_state
from tests.engines.test_engines import make_model
from tests.tiny_lm import TokStub as Tok

pytestmark = pytest.mark.cpu_only("mocks CUDA's memory calls")

GIB = 2**30
QWEN_1_5B = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
SHAPE = mw.model_shape(QWEN_1_5B)
# Qwen2.5-1.5B in bf16, 64 prompts x 16 of 256 + 2,048 tokens, micro-batches of 2 rows, on an 80 GiB device
OVERRIDES = ["rollout.prompts_per_step=64", "rollout.n=16", "rollout.max_new_tokens=2048", "model.dtype=bfloat16",
             "optim.micro_batch_size=2", "task.max_prompt_length=256"]
PROMPTS, COUNTS, STEPS = [[5] * 256 for _ in range(64)], [16] * 64, 2048


class FakeDevice:
    """An 80 GiB GPU as CUDA and the caching allocator report it: `allocated` bytes in use, and cached free blocks in
    the default pool and in a CUDA graphs' private pool."""

    def __init__(self, allocated: int, default_free: int = 0, private_free: int = 0, total: int = 80 * GIB):
        self.total, self.allocated = total, allocated
        self.reserved = allocated + default_free + private_free
        self.segments = [
            {"device": 0, "segment_pool_id": (0, 0), "total_size": allocated + default_free, "allocated_size": allocated},
            {"device": 0, "segment_pool_id": (1, 0), "total_size": private_free, "allocated_size": 0},
        ]

    def install(self, monkeypatch) -> None:
        for module in {fast, sys.modules[fast.plan_rows_in_flight.__module__]}:  # the engine's and the plan's
            monkeypatch.setattr(module, "model_device", lambda model: torch.device("cuda", 0))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.total - self.reserved, self.total))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *args, **kwargs: self.segments)


def bucketed_engine() -> fast.FastEngine:
    """A fast engine whose state stays between calls (buckets, as under CUDA graphs) on a 1.5B-shaped plan: the
    model samples nothing here, its dtype (bf16) and the plan's shape are what the rows are read from."""
    engine = fast.FastEngine(make_model("qwen").to(torch.bfloat16), Tok())
    engine.buckets = Buckets(block=64)
    engine.shape = SHAPE
    return engine


def test_a_kept_decode_state_is_sized_by_the_plan_not_by_the_first_calls_free_memory(monkeypatch):
    """At step 1 the device holds only the weights: its free memory fits 1,024 rows, where the plan, which counts
    the optimiser's state and the fused weights resident, keeps 512 beside the update (62.7 GiB at 2 rows a
    micro-batch). The trainer keeps the state through the update: at 1,024 rows the update's peak is 95 GiB of the
    80 GiB device. The engine decodes the plan's rows at step 1 and after the first optimiser step alike."""
    cfg = load_config("podsrl/configs/pods.yaml", OVERRIDES)
    engine = bucketed_engine()
    assert engine.keeps_state_across_updates
    monkeypatch.setattr(engine_state, "device_memory", lambda device: 80 * GIB)
    model = SimpleNamespace(config=QWEN_1_5B)
    assert engine_state.keeps_engine_state(cfg, cfg.optim.micro_batch_size, engine, model, None, None,
                                           torch.device("cuda"), 1, False)
    work = dataclasses.replace(workload_from_config(cfg, 256, "cuda"), kept_decode_state=True)
    budget = int(80 * GIB * (1 - mp.RESERVE))
    planned = mp.with_rows_in_flight(SHAPE, work, budget).generation_rows
    assert planned == 512
    state = mp.model_state(SHAPE, work)
    weights, optimizer = state["weights"], state["optimizer"]
    FakeDevice(allocated=weights).install(monkeypatch)  # step 1: no optimiser state, no gradients yet
    first = engine.rows_in_flight(PROMPTS, COUNTS, STEPS, 1.0)
    fused = mp.engine_fused_weights(SHAPE, work)
    FakeDevice(allocated=weights + optimizer + fused).install(monkeypatch)  # after the first optimiser step
    later = engine.rows_in_flight(PROMPTS, COUNTS, STEPS, 1.0)
    peak = sum(mp.update_peak(SHAPE, dataclasses.replace(work, rows_in_flight=first), 2, False).values())
    assert first == later == planned, (first, later)
    assert peak <= budget, f"{peak / GIB:.1f} GiB"
    twice = dataclasses.replace(work, rows_in_flight=2 * planned)
    assert sum(mp.update_peak(SHAPE, twice, 2, False).values()) > 80 * GIB  # the 1,024 rows step 1's memory fits


def test_free_blocks_of_the_graphs_private_pool_are_not_counted_as_free(monkeypatch):
    """20 GiB cached in the CUDA graphs' private pool (free blocks only a capture into that pool can reuse): the
    rows in flight are what the device's free memory and the default pool's free blocks hold (512), not what
    counting the private pool's too would size (1,024 rows, 7 GiB past the device)."""
    engine = bucketed_engine()
    weights = mp.model_state(SHAPE, workload_from_config(load_config("podsrl/configs/pods.yaml", OVERRIDES), 256,
                                                         "cuda"))["weights"]
    FakeDevice(allocated=weights, default_free=2 * GIB, private_free=20 * GIB).install(monkeypatch)
    rows = engine.rows_in_flight(PROMPTS, COUNTS, STEPS, 1.0)
    work = mw.Workload(prompts=64, n=16, m=1, prompt_length=256, completion_length=STEPS, dtype="bfloat16",
                       compute_dtype="bfloat16", device="cuda")
    usable = 80 * GIB - weights - 20 * GIB  # free on the device, and the default pool's 2 GiB
    assert rows == mp.rows_in_flight(SHAPE, work, usable) == 512
    assert mp.rows_in_flight(SHAPE, work, usable + 20 * GIB) == 1024
