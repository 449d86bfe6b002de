"""Peak memory of a step's episodes whose tool answers 10 MB, against the same episodes answered normally: run as
`python -m tests.episodes.response_memory [MEGABYTES]` (its own process, so its peak RSS is its own), it prints
{"normal_mb", "large_mb", "normal_seconds", "seconds"}: the process's peak resident memory after the normal episodes
(twice, so every buffer has been allocated once) and after the large ones, and the wall time of each. The built-in model (small)
samples on the fast engine; the environment answers every turn as if the model had called the tool, so the tool's
answer runs the whole path (call pool, cut, render, tokenize, prefill)."""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

from podsrl.batch import Problem
from podsrl.config import EpisodeConfig, TinyModelConfig
from podsrl.engines.base import SamplingParams
from podsrl.engines.fast import FastEngine
from podsrl.episodes.environment import ToolEnvironment
from podsrl.episodes.runner import EpisodeRunner
from podsrl.models.loading import build_char_tokenizer, build_tiny_model

ANSWER = {"size": 2}


def answer(x: int) -> str:
    """Answers with ANSWER["size"] characters.

    Args:
        x: anything.
    """
    return "7" * ANSWER["size"]


class CallingEnvironment(ToolEnvironment):
    def step(self, assistant_text: str):
        return super().step('<tool_call>{"name": "answer", "arguments": {"x": 1}}</tool_call>')


class Task:
    def environment(self, tool_timeout_s: float) -> CallingEnvironment:
        return CallingEnvironment([answer], tool_timeout_s)


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(megabytes: float) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                             max_position_embeddings=160), tokenizer)
    runner = EpisodeRunner(FastEngine(model, tokenizer), tokenizer, Task(), EpisodeConfig(max_turns=3, max_tokens=128),
                           context=160)
    problems = [Problem(uid="a", prompt="47+8=", answer="55")]
    params = SamplingParams(max_new_tokens=32)
    for _ in range(2):
        start = time.perf_counter()
        runner.run(problems, [2], params, torch.tensor([1, 2]))
        normal_seconds = time.perf_counter() - start
    normal = peak_mb()
    ANSWER["size"] = int(megabytes * 1_000_000)
    start = time.perf_counter()
    out = runner.run(problems, [2], params, torch.tensor([1, 2]))
    seconds = time.perf_counter() - start
    assert out.stats.truncated_responses >= 2, out.stats
    print(json.dumps({"normal_mb": normal, "large_mb": peak_mb(), "normal_seconds": normal_seconds,
                      "seconds": seconds}))


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 10.0)
