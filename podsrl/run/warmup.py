"""Supervised warm-up of the built-in model on reference completions, cached by config.

RL needs a starting policy that is right part of the time. The warm-up is deterministic given its config, so every
run of a comparison starts from byte-identical weights, and it is cached under a key of everything that shapes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from podsrl.config import Config, TaskConfig, to_dict
from podsrl.models.loading import build_char_tokenizer, build_tiny_model, resolve_device
from podsrl.run.tracking import build_progress
from podsrl.tasks import build_task

log = logging.getLogger("podsrl")


# Bumped whenever the built-in task or warm-up code changes what a given config produces, so stale caches are ignored.
WARMUP_VERSION = 2


def warmup_task_config(task: TaskConfig) -> TaskConfig:
    """The task as the warm-up sees it: the whole problem stream, without a training pool (`train_size`), so runs
    with and without a pool start from the same warmed-up weights."""
    return dataclasses.replace(task, args={k: v for k, v in task.args.items() if k != "train_size"})


def warmup_key(cfg: Config) -> str:
    task = to_dict(warmup_task_config(cfg.task))
    for key in ("eval_fraction", "max_prompt_length", "overlong_prompts"):  # no effect on the warm-up: keep caches
        task.pop(key)
    shaping = {"version": WARMUP_VERSION, "tiny": to_dict(cfg.model.tiny), "task": task, "warmup": to_dict(cfg.warmup)}
    for key in ("cache_dir", "shipped"):  # where the weights are found, not what they are
        shaping["warmup"].pop(key)
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


# Warm-ups shipped with the package, one directory per key: the default run's, so every machine starts RL from the
# same weights (tests/test_shipped_warmup.py checks the key and shapes against the current code).
SHIPPED = Path(__file__).parents[1] / "warmups"


def warmup_path(cfg: Config) -> Path:
    return Path(cfg.warmup.cache_dir) / warmup_key(cfg)


def shipped_warmup(cfg: Config) -> Path | None:
    """The shipped warm-up of this config's key, if there is one and warmup.shipped allows it."""
    path = SHIPPED / warmup_key(cfg)
    return path if cfg.warmup.shipped and (path / "config.json").is_file() else None


def needs_warmup(cfg: Config) -> bool:
    return cfg.model.name_or_path == "tiny" and cfg.warmup.steps > 0


def sft_batch(tokenizer, prompts: list[str], targets: list[str]):
    """Right-padded ids, attention mask and labels (-100 on prompt and padding), EOS after each target."""
    eos = tokenizer.eos_token_id
    rows = []
    for p, t in zip(prompts, targets):
        pi = tokenizer(p, add_special_tokens=False).input_ids
        ti = tokenizer(t, add_special_tokens=False).input_ids + [eos]
        rows.append((pi + ti, [-100] * len(pi) + ti))
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return ids, mask, labels


def validation_tokens(tokenizer, task, problems) -> int:
    """New tokens the validation generates: the longest reference completion and its EOS, at least 8 (the fixed cap
    it had before worked solutions: warm-ups whose answers have at most 7 characters are unchanged)."""
    longest = max(len(tokenizer(task.reference_completion(p), add_special_tokens=False).input_ids) for p in problems)
    return max(8, longest + 1)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task, problems, max_new_tokens: int = 8) -> float:
    """Greedy exact-match accuracy with plain `generate` (warm-up validation only; RL evaluation uses the engine)."""
    was_training = model.training
    model.eval()
    enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True, add_special_tokens=False)
    enc = enc.to(model.device)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return sum(task.is_correct(t, p) for t, p in zip(texts, problems)) / len(problems)


def run_warmup(cfg: Config, progress: bool = True, use_shipped: bool = True) -> Path:
    """The warmed-up base checkpoint's directory: the shipped one of this key (unless warmup.shipped is false or
    `use_shipped` is False: `podsrl warmup` builds this machine's own), else the cached one, else trained and
    cached."""
    shipped = shipped_warmup(cfg) if use_shipped else None
    if shipped is not None:
        return shipped
    out = warmup_path(cfg)
    if (out / "config.json").is_file():
        return out
    task = build_task(warmup_task_config(cfg.task))
    tokenizer = build_char_tokenizer()
    # On the run's device (a 25M model would take hours on a few CPU cores); the cache key ignores the device, so a
    # warm-up made on one machine serves runs on another. Weights are built on the CPU first: the same start anywhere.
    device = resolve_device(cfg.model.device)
    model = build_tiny_model(cfg.model.tiny, tokenizer, seed=cfg.warmup.seed).to(device)
    w = cfg.warmup
    gen = torch.Generator().manual_seed(w.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=0.0)
    # Linear warm-up of the LR over 50 steps, then constant: the stopping step is set by the accuracy target.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
    # Warm-up and its validation draw from far ends of the training index space so RL's own prompts are fresh.
    offset = 10**9
    validation = [task.problem(2 * 10**9 + i) for i in range(w.validation_size)]
    max_new_tokens = validation_tokens(tokenizer, task, validation)
    start = time.perf_counter()
    accuracy, steps_run = float("nan"), 0
    model.train()
    bar = build_progress(cfg, w.steps, progress, label="warm-up")
    try:
        for step in range(w.steps):
            if w.target_accuracy > 0 and step > 0 and step % w.check_every == 0:
                accuracy = greedy_accuracy(model, tokenizer, task, validation, max_new_tokens)
                if accuracy >= w.target_accuracy:
                    break
            idx = torch.randint(0, 10**8, (w.batch_size,), generator=gen).tolist()
            problems = [task.problem(offset + i) for i in idx]
            ids, mask, labels = sft_batch(tokenizer, [p.prompt for p in problems],
                                          [task.reference_completion(p) for p in problems])
            loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            steps_run = step + 1
            bar.update(steps_run, loss=loss.item(), val_acc=accuracy)
    finally:
        bar.close()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if w.target_accuracy > 0:
        accuracy = greedy_accuracy(model, tokenizer, task, validation, max_new_tokens)
    info = {"seconds": time.perf_counter() - start, "steps": steps_run, "validation_accuracy": accuracy}
    (tmp / "warmup.json").write_text(json.dumps(info))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished the same warm-up first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("warm-up: %d steps, validation accuracy %.3f, %.1fs -> %s", steps_run, accuracy,
             info["seconds"], out)
    return out
