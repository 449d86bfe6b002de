"""Held-out evaluation: greedy pass@1, sampled Avg@k and unbiased pass@k.

For a task with an environment each sample is an episode, run by the same episode runner as training (the model
calls its tools), and the greedy pass reports the episodes' tool calls and faults.

Sampling seeds are a fixed function of the problem and sample index, so every run of a comparison is scored with the
same random numbers (common random numbers: differences between methods are not sampling noise of the eval).
"""

from __future__ import annotations

import math

import torch

from podsrl.batch import Problem
from podsrl.engines.base import RolloutEngine, SamplingParams
from podsrl.episodes.runner import EpisodeRunner
from podsrl.episodes.stats import EpisodeStats

EVAL_SEED = 0x5EED


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) from n samples with c correct (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n (k={k}, n={n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _generate_text(engine: RolloutEngine, tokenizer, problems: list[Problem], counts: int, params: SamplingParams,
                   batch_size: int, episodes: EpisodeRunner | None,
                   stats: EpisodeStats) -> tuple[list[str], list | None]:
    """Each problem's `counts` completions, and with `episodes` their episodes' environments (which an
    environment's reward reads) and their counts in `stats`."""
    texts: list[str] = []
    environments: list | None = None if episodes is None else []
    per_call = max(1, batch_size // counts)
    for start in range(0, len(problems), per_call):
        chunk = problems[start : start + per_call]
        prompts = [tokenizer(p.prompt, add_special_tokens=False).input_ids for p in chunk]
        idx = torch.arange(start, start + len(chunk)).repeat_interleave(counts)
        seeds = EVAL_SEED * 1_000_003 + idx * 1009 + torch.arange(counts).repeat(len(chunk))
        if episodes is None:
            out = engine.generate(prompts, [counts] * len(chunk), params, seeds)
        else:
            run = episodes.run(chunk, [counts] * len(chunk), params, seeds)
            out = run.generation
            stats.add(run.stats)
            environments.extend(run.environments)
        ids = out.completion_ids.masked_fill(out.completion_mask == 0, tokenizer.pad_token_id)
        texts.extend(tokenizer.batch_decode(ids, skip_special_tokens=True))
    return texts, environments


def evaluate(engine: RolloutEngine, tokenizer, problems: list[Problem], verify, max_new_tokens: int,
             samples: int = 0, temperature: float = 1.0, top_p: float = 1.0, batch_size: int = 1024,
             episodes: EpisodeRunner | None = None) -> dict:
    """{"eval/accuracy": greedy pass@1, "eval/avg@k", "eval/pass@k", "eval/mean_length"} over `problems`; with
    `episodes` (the task's episode runner on `engine`) each sample is an episode, and the greedy pass adds
    "eval/tool_calls" and "eval/tool_faults" (per episode) and "eval/turns" (mean per episode).

    `verify(problems, group_index, completions, environments) -> [R] bool` is the run's correctness check (the
    `correct` reward; `environments`: each episode's environment, None for single-turn completions).
    Callers skip evaluation when there is no eval set (the trainer says so at start-up).
    """
    if not problems:
        raise ValueError("evaluate: no problems (the caller should skip evaluation without an eval set)")
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, return_logprobs=False)
    stats = EpisodeStats()
    texts, environments = _generate_text(engine, tokenizer, problems, 1, greedy, batch_size, episodes, stats)
    correct = verify(problems, torch.arange(len(problems)), texts, environments)
    metrics = {"eval/accuracy": float(correct.float().mean()),
               "eval/mean_length": sum(map(len, texts)) / len(texts)}
    if episodes is not None:
        metrics.update({"eval/tool_calls": sum(stats.tool_calls.values()) / stats.episodes,
                        "eval/tool_faults": sum(stats.tool_faults.values()) / stats.episodes,
                        "eval/turns": stats.turns / stats.episodes})
    if samples > 0:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                return_logprobs=False)
        texts, environments = _generate_text(engine, tokenizer, problems, samples, params, batch_size, episodes,
                                             EpisodeStats())
        group_index = torch.arange(len(problems)).repeat_interleave(samples)
        per_problem = torch.bincount(group_index, weights=verify(problems, group_index, texts, environments).float(),
                                     minlength=len(problems)).round().long().tolist()
        metrics[f"eval/avg@{samples}"] = sum(per_problem) / (samples * len(problems))
        metrics[f"eval/pass@{samples}"] = sum(pass_at_k(samples, c, samples) for c in per_problem) / len(problems)
    return metrics
