"""Shared pieces of the fault tests: a tiny run configuration, run-directory readers and comparisons."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from podsrl.reporting.tracking import read_metrics
from podsrl.run.checkpoint import latest_checkpoint

HERE = Path(__file__).resolve().parent
REWARDS = HERE / "rewards_faulty.py"
MAX_STEPS, SAVE_EVERY = 6, 2

# Overrides for `tiny`: the built-in episode task at the docs' char-level sizes. Its warm-up teaches the call on
# every reference episode (tool_share 1), so the tiny model calls the calculator in a good share of its episodes:
# they run several turns.
EPISODES = {"task.name": "arithmetic_tool", "task.args": "{operands: 2, digits: 1, tool_share: 1.0}",
            "model.tiny.max_position_embeddings": 160, "rollout.max_new_tokens": 96, "episode.max_tokens": 128,
            "episode.max_turns": 3, "warmup.episode_steps": 300, "warmup.episode_batch_size": 8,
            "warmup.validation_size": 8, "warmup.lr": 0.003, "optim.lr": 1e-4}


def tiny(run_dir: Path, cache: str | Path, **extra) -> list[str]:
    """Overrides for a run of a few seconds: a 1-layer model, 4 prompts x 4 rollouts, 6-token completions."""
    base = {
        "output_dir": run_dir, "seed": 7,
        "warmup.cache_dir": cache, "warmup.steps": 10, "warmup.batch_size": 8,
        "model.tiny.num_layers": 1, "model.tiny.hidden_size": 32, "model.tiny.num_heads": 2,
        "model.tiny.intermediate_size": 64,
        "task.args": "{operands: 2, digits: 1}", "task.eval_size": 8, "eval.samples": 0,
        "rollout.prompts_per_step": 4, "rollout.n": 4, "rollout.max_new_tokens": 6,
        "method": "pods", "pods.m": 2, "optim.lr": 0.01,
        "rewards": f"[{{name: correct}}, {{name: spread, function: '{REWARDS}:spread'}}]",
        "train.max_steps": MAX_STEPS, "train.save_every": SAVE_EVERY, "train.eval_every": 3,
        "log.progress": False, "log.tensorboard": False, "log.plot": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train_argv(run_dir: Path, cache, **extra) -> list[str]:
    return ["train", "--config", "grpo", *tiny(run_dir, cache, **extra)]


def resume_argv(run_dir: Path) -> list[str]:
    return ["train", "--resume", str(run_dir)]


def records(run_dir: Path) -> list[dict]:
    """Every record of metrics.jsonl without its time/* keys (wall times differ between runs)."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(run_dir / "metrics.jsonl")]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(latest_checkpoint(run_dir) / "model" / "model.safetensors")


def assert_same_run(run: Path, reference: Path) -> None:
    """Same metric records (every key but time/*, every step and eval record) and bit-identical final weights."""
    got, want = records(run), records(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g == w, f"step {w['step']}: " + str({k: (g.get(k), w.get(k)) for k in set(g) | set(w)
                                                     if g.get(k) != w.get(k)})
    a, b = final_weights(run), final_weights(reference)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def last_step(run_dir: Path) -> int:
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]
    return max(steps, default=0)


def wait_for_step(run_dir: Path, step: int, child, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while last_step(run_dir) < step:
        assert child.poll() is None, f"run ended before step {step}: {child.stderr()[-2000:]}"
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout} s"
        time.sleep(0.05)


def error_line(stderr: str) -> str:
    """The CLI's one-line error: no traceback, and exactly one 'podsrl: error:' line."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("podsrl: error:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]
