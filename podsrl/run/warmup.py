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

from podsrl.config import Config, EpisodeConfig, TaskConfig, TinyModelConfig, to_dict
from podsrl.models.loading import build_char_tokenizer, build_tiny_model, load_tiny_at_context, resolve_device
from podsrl.reporting.tracking import build_progress
from podsrl.sandbox.box import SandboxLimits
from podsrl.sandbox.isolation import allow_unisolated, require_isolation
from podsrl.tasks import build_task, task_class

log = logging.getLogger("podsrl")


# Bumped whenever the built-in task or warm-up code changes what a given config produces, so stale caches are ignored.
WARMUP_VERSION = 2
# A task whose warm-up changed since has a version of its own (Task.warmup_version): in its key alone, so other keys
# (the shipped warm-up's) stay. An episode task may continue the warm-up of a single-turn task (Task.plain_task).
EPISODE_KEYS = ("episode_steps", "episode_batch_size")  # warmup.* read by the episode phase alone
# episode.* keys newer than arithmetic_tool 1: in its key only when set away from their defaults, so caches stay
LATER_EPISODE_KEYS = ("env_timeout_s", "timeout_s", "max_hung_calls", "max_parallel_calls", "max_response_chars",
                      "response_truncate_side", "tool_format")
RL_EPISODE_KEYS = ("credit", "turn_discount")  # read by RL's advantages alone: never in the key


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
    version = task_class(cfg.task.name).warmup_version
    if version is not None:
        episode, defaults = to_dict(cfg.episode), to_dict(EpisodeConfig())
        shaping.update(task_version=version,
                       episode={k: v for k, v in episode.items() if k not in RL_EPISODE_KEYS
                                and (k not in LATER_EPISODE_KEYS or v != defaults[k])})
    else:
        for key in EPISODE_KEYS:
            shaping["warmup"].pop(key)
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


# Warm-ups shipped with the package, one directory per key: the default run's, so every machine starts RL from the
# same weights (tests/run/test_shipped_warmup.py checks the key and shapes against the current code).
SHIPPED = Path(__file__).parents[1] / "warmups"


def plain_warmup_config(cfg: Config) -> Config | None:
    """The config of the single-turn warm-up an episode task's warm-up starts from (its task's plain twin, without
    the episode task's own arguments, at the default context), or None for a task whose warm-up starts from fresh
    weights."""
    cls = task_class(cfg.task.name)
    if cls.plain_task is None:
        return None
    plain, args = cls.plain_task, cls.plain_args(cfg.task.args)
    # at the built-in model's own context, which the plain task's rows fit: positions are rotary, not weights, so
    # the weights serve the episodes' longer context, and the default run's warm-up (the shipped one) is shared
    tiny = dataclasses.replace(cfg.model.tiny, max_position_embeddings=TinyModelConfig().max_position_embeddings)
    return dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, name=plain, args=args),
                               model=dataclasses.replace(cfg.model, tiny=tiny))


def warmup_path(cfg: Config) -> Path:
    return Path(cfg.warmup.cache_dir) / warmup_key(cfg)


def shipped_warmup(cfg: Config) -> Path | None:
    """The shipped warm-up of this config's key, if there is one and warmup.shipped allows it."""
    path = SHIPPED / warmup_key(cfg)
    return path if cfg.warmup.shipped and (path / "config.json").is_file() else None


def needs_warmup(cfg: Config) -> bool:
    return cfg.model.name_or_path == "tiny" and cfg.warmup.steps > 0


def base_weights(cfg: Config, progress: bool = False) -> str | None:
    """The weights a run starts from: the cached warm-up of the built-in model (trained if missing), else None
    (model.name_or_path)."""
    return str(run_warmup(cfg, progress=progress)) if needs_warmup(cfg) else None


def resume_base_weights(cfg: Config, checkpoint: Path, progress: bool = False) -> str | None:
    """The warm-up a run resumed from `checkpoint` still reads, or None: the checkpoint holds the policy's weights,
    so only a reference model (algo.beta > 0) or LoRA's frozen base (the checkpoint holds the adapter) need the
    warm-up. A missing one is then trained again, saying so and why; one nothing reads is never trained."""
    if not needs_warmup(cfg):
        return None
    readers = [why for why, needed in (("algo.beta > 0: the reference model is the warm-up", cfg.algo.beta > 0),
                                       ("model.lora_rank > 0: the checkpoint holds the adapter, the warm-up is "
                                        "its base", cfg.model.lora_rank > 0)) if needed]
    if not readers:
        return None
    if present_warmup(cfg) is None:
        log.warning("resume: the warm-up this run started from (%s) is missing and %s needs it (%s): training it "
                    "again, up to warmup.steps=%d steps", warmup_path(cfg), checkpoint, "; ".join(readers),
                    cfg.warmup.steps)
    return base_weights(cfg, progress)


def present_warmup(cfg: Config, use_shipped: bool = True) -> Path | None:
    """The warm-up of this config already on disk (the shipped one of its key, else the cached one), or None."""
    shipped = shipped_warmup(cfg) if use_shipped else None
    if shipped is not None:
        return shipped
    out = warmup_path(cfg)
    return out if (out / "config.json").is_file() else None


def sft_batch(tokenizer, prompts: list[str], targets: list[str]):
    """Right-padded ids, attention mask and labels (-100 on prompt and padding), EOS after each target. A prompt is
    the context of a model turn, so an episode's tool answers in it get no loss, as RolloutBatch.loss_mask in RL."""
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


def reference_rows(task, problems) -> tuple[list[str], list[str]]:
    """(contexts, targets): one supervised row per model turn of each problem's reference episode."""
    turns = [turn for p in problems for turn in task.reference_turns(p)]
    return [context for context, _ in turns], [target for _, target in turns]


def validation_tokens(tokenizer, task, problems) -> int:
    """New tokens (per turn) the validation generates: the longest reference turn and its EOS, at least 8 (the fixed
    cap it had before worked solutions: warm-ups whose answers have at most 7 characters are unchanged)."""
    _, targets = reference_rows(task, problems)
    return max(8, max(len(tokenizer(t, add_special_tokens=False).input_ids) for t in targets) + 1)


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


def episode_validation(model, tokenizer, task, problems, max_new_tokens: int, cfg: Config) -> dict:
    """Greedy pass@1 of the episodes of a task with an environment, and their tool calls and faults per episode:
    the held-out evaluation's own measure (run through the episode runner), on the warm-up's validation stream."""
    from podsrl.engines.hf import HFEngine
    from podsrl.episodes.runner import EpisodeRunner
    from podsrl.run.evaluation import evaluate

    def verify(problems_, group_index, texts, environments=None):  # the task's own check: no environment reward
        return torch.tensor([task.is_correct(t, problems_[g]) for t, g in zip(texts, group_index.tolist())])

    engine = HFEngine(model, tokenizer)  # generates in eval mode, the model's train mode kept
    return evaluate(engine, tokenizer, problems, verify, max_new_tokens, batch_size=len(problems),
                    episodes=EpisodeRunner(engine, tokenizer, task, cfg.episode))


def validate(model, tokenizer, task, problems, max_new_tokens: int, cfg: Config) -> dict:
    """{"validation_accuracy": greedy accuracy, and for episodes "validation_tool_calls" and
    "validation_tool_faults" (per episode)}."""
    if not task.has_environment():
        return {"validation_accuracy": greedy_accuracy(model, tokenizer, task, problems, max_new_tokens)}
    m = episode_validation(model, tokenizer, task, problems, max_new_tokens, cfg)
    return {"validation_accuracy": m["eval/accuracy"], "validation_tool_calls": m["eval/tool_calls"],
            "validation_tool_faults": m["eval/tool_faults"]}


def run_warmup(cfg: Config, progress: bool = True, use_shipped: bool = True) -> Path:
    """The warmed-up base checkpoint's directory: the shipped one of this key (unless warmup.shipped is false or
    `use_shipped` is False: `podsrl warmup` builds this machine's own), else the cached one, else trained and
    cached."""
    present = present_warmup(cfg, use_shipped)
    if present is not None:
        return present
    out = warmup_path(cfg)
    allow_unisolated(cfg.episode.sandbox == "unisolated")
    task = build_task(warmup_task_config(cfg.task))
    if task.runs_programs:  # its reference episodes run programs: said (or refused) before any training
        require_isolation(SandboxLimits.max_processes)
    w = cfg.warmup
    # On the run's device (a 25M model would take hours on a few CPU cores); the cache key ignores the device, so a
    # warm-up made on one machine serves runs on another. Weights are built on the CPU first: the same start anywhere.
    device = resolve_device(cfg.model.device)
    tokenizer = build_char_tokenizer()
    plain = plain_warmup_config(cfg)
    if plain is None:
        model = build_tiny_model(cfg.model.tiny, tokenizer, seed=w.seed)
        steps, batch_size, target_accuracy = w.steps, w.batch_size, w.target_accuracy
    else:  # the episodes' calls on top of the plain warm-up's sums; a fixed number of steps
        model = load_tiny_at_context(run_warmup(plain, progress, use_shipped), cfg.model.tiny.max_position_embeddings)
        steps, batch_size, target_accuracy = w.episode_steps, w.episode_batch_size, 0.0
    model.to(device)
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
    bar = build_progress(cfg, steps, progress, label="warm-up" if plain is None else "episode warm-up")
    try:
        for step in range(steps):
            if target_accuracy > 0 and step > 0 and step % w.check_every == 0:
                accuracy = validate(model, tokenizer, task, validation, max_new_tokens, cfg)["validation_accuracy"]
                if accuracy >= target_accuracy:
                    break
            idx = torch.randint(0, 10**8, (batch_size,), generator=gen).tolist()
            problems = [task.problem(offset + i) for i in idx]
            ids, mask, labels = sft_batch(tokenizer, *reference_rows(task, problems))
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
    validation_metrics = {"validation_accuracy": accuracy}
    if target_accuracy > 0 or task.has_environment():  # an episode task's warm-up says how often it calls
        validation_metrics = validate(model, tokenizer, task, validation, max_new_tokens, cfg)
    accuracy = validation_metrics["validation_accuracy"]
    info = {"seconds": time.perf_counter() - start, "steps": steps_run, **validation_metrics}
    (tmp / "warmup.json").write_text(json.dumps(info))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished the same warm-up first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("warm-up: %d steps, validation accuracy %.3f, %.1fs -> %s", steps_run, accuracy,
             info["seconds"], out)
    return out
