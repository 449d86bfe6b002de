"""A scripted StepContext for method tests: rollouts are not sampled, their correctness comes from a script."""

from __future__ import annotations

from collections.abc import Callable

import torch

from podsrl.batch import Problem, RolloutBatch
from podsrl.config import Config, load_config
from podsrl.prompt_stats import PromptStats


def problems(count: int, start: int = 0) -> list[Problem]:
    return [Problem(uid=f"p{i}", prompt=f"q{i}", answer="1") for i in range(start, start + count)]


def scored_batch(batch_problems: list[Problem], indices: list[int], counts: list[int],
                 bits: list[bool]) -> RolloutBatch:
    rows = sum(counts)
    group_index = torch.tensor([i for i, c in zip(indices, counts) for _ in range(c)], dtype=torch.long)
    batch = RolloutBatch(problems=batch_problems, group_index=group_index,
                         prompt_ids=torch.ones((rows, 2), dtype=torch.long),
                         prompt_mask=torch.ones((rows, 2), dtype=torch.long),
                         completion_ids=torch.ones((rows, 3), dtype=torch.long),
                         completion_mask=torch.ones((rows, 3)), truncated=torch.zeros(rows, dtype=torch.bool))
    batch.correct = torch.tensor(bits, dtype=torch.bool)
    batch.rewards = batch.correct.float()
    batch.completions = [""] * rows
    return batch


class ScriptedContext:
    """`outcome(uid, k)` is the correctness of the k-th rollout ever drawn for prompt `uid` (k from 0)."""

    def __init__(self, cfg: Config, outcome: Callable[[str, int], bool], seed: int = 0, epoch: int = 0,
                 pool: list[Problem] | None = None) -> None:
        self.cfg, self.outcome, self.epoch, self.step = cfg, outcome, epoch, 0
        self.stats = PromptStats()
        self.rng = torch.Generator().manual_seed(seed)
        self.pad_token_id = 0
        self.pool = pool or []
        self.position = 0
        self.drawn: dict[str, int] = {}
        self.calls: list[tuple[list[str], list[int]]] = []

    def generate(self, batch_problems, indices, counts) -> RolloutBatch:
        bits = []
        for i, c in zip(indices, counts):
            uid = batch_problems[i].uid
            k = self.drawn.get(uid, 0)
            bits += [bool(self.outcome(uid, k + j)) for j in range(c)]
            self.drawn[uid] = k + c
        self.calls.append(([batch_problems[i].uid for i in indices], list(counts)))
        return scored_batch(batch_problems, list(indices), list(counts), bits)

    def draw(self, count: int) -> list[Problem]:
        out = [self.pool[(self.position + i) % len(self.pool)] for i in range(count)]
        self.position += count
        return out


def method_config(method: type, *overrides: str) -> Config:
    """Defaults <- overrides, with `method` chosen and its own cross-field checks run."""
    cfg = load_config(None, [f"method={method.name}", *overrides])
    method.validate(cfg)
    return cfg


def train_preset(preset: str, run_dir, warmup_cache: str, **extra) -> list[dict]:
    """Train a bundled preset at test size (tests/conftest.py's tiny run, a pool of 8 problems and a hash of the
    completion standing in for correctness, so outcomes vary from the first step); return its step records."""
    from podsrl.reporting.tracking import read_metrics
    from podsrl.run.trainer import Trainer
    from tests.conftest import tiny_overrides
    from tests.faults.common import REWARDS

    overrides = {"task.args": "{operands: 2, digits: 1, train_size: 8}",
                 "rewards": f"[{{name: correct, function: '{REWARDS}:spread'}}]", "train.max_steps": 6, **extra}
    Trainer(load_config(f"podsrl/configs/{preset}.yaml", tiny_overrides(run_dir, warmup_cache, **overrides))).train()
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]
