"""Reward functions, their weights, and what happens when one misbehaves.

A reward function has TRL's signature: `f(prompts, completions, **columns) -> list[float | None]`, one value per
rollout. `columns` holds `answer`, `problem_uid` and every key of the problems' metadata, each a list of length R.

RewardManager calls every function once per step and turns faults into policy: a function that raises, runs past
`timeout_s`, returns the wrong number of values (a bare scalar is never broadcast), or returns None / NaN / inf /
a non-number is counted in metrics ("rewards/<name>/errors", ".../timeouts", ".../invalid") and then
  zero -> the affected values count as 0,
  skip -> the affected rollouts get valid=False (the trainer drops them; their reward is NaN),
  fail -> podsrl.errors.UserError naming the function and the problem.
The first fault of each function is logged as a warning saying which function and why (later ones at debug level,
the metrics count them all). A function whose every value is faulty in `max_faulty_calls` calls in a row is broken,
not unlucky (e.g. it returns one number for the whole batch, which TRL broadcasts silently: huggingface/trl#6533),
so the run stops with a UserError whatever the policy, instead of training on filled-in values forever.

User functions run on a helper thread so a hung call can be abandoned (Python cannot kill a thread; a function
that spins forever keeps its thread busy, so bound your own loops). Consequently they must not rely on signals:
call `verify_answers` below instead of math-verify directly. The built-in `correct` runs the task's own verifier
(`Task.score`) when the task has one, else math-verify in worker processes with a per-item timeout.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import numbers
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from podsrl.batch import Problem
from podsrl.errors import ConfigError, UserError
from podsrl.extras import require
from podsrl.math_verify_pool import MathVerifyPool, default_math_verify_pool

if TYPE_CHECKING:  # a task is only called here: rewards.py stands below tasks/ (whose environments it loads)
    from podsrl.tasks.base import Task

logger = logging.getLogger("podsrl")

RewardFn = Callable[..., Sequence[Any]]
ON_ERROR = ("zero", "skip", "fail")
CORRECT_THRESHOLD = 0.5  # a rollout is correct when its `correct` reward is at least this


# ---------------------------------------------------------------------------------------------------------------
# Built-in reward functions

ENVIRONMENTS = "environments"  # the column of each episode's environment (TRL's reward-function argument)


def _problems_from_columns(prompts: Sequence[str], columns: dict[str, Sequence[Any]]) -> list[Problem]:
    """Rebuild the per-rollout Problem a verifier needs from TRL-style columns."""
    meta_keys = [k for k in columns if k not in ("answer", "problem_uid")]
    uids = columns.get("problem_uid") or [str(i) for i in range(len(prompts))]
    return [
        Problem(uid=str(uids[i]), prompt=prompts[i], answer=str(columns["answer"][i]),
                metadata={k: columns[k][i] for k in meta_keys})
        for i in range(len(prompts))
    ]


class TaskVerifierReward:
    """`correct` for a task with its own verifier: `task.score(completion, problem)` (1.0/0.0, or partial credit)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.__name__ = "correct"

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]) -> list[float]:
        environments = columns.pop(ENVIRONMENTS, None)
        problems = _problems_from_columns(prompts, columns)
        return self.task.score_batch(list(completions), problems, environments)


class MathVerifyReward:
    """`correct` for dataset tasks: math-verify of the completion's final answer against the gold answer. The
    answer is read from the last <answer> block, else the last \\boxed{}, else the last 2,000 characters
    (podsrl.answers.answer_region).

    Runs in worker processes (math-verify is not thread-safe); an item past the per-item timeout is reported
    through `score_detailed` so the manager counts it as a timeout. Called directly (as TRL would), timed-out
    items come back as None.
    """

    manages_own_timeout = True

    def __init__(self, pool: MathVerifyPool | None = None) -> None:
        self._pool = pool
        self.__name__ = "correct"

    @property
    def pool(self) -> MathVerifyPool:
        return self._pool if self._pool is not None else default_math_verify_pool()

    def score_detailed(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> tuple[list[float | None], list[bool]]:
        checked = self.pool.check([str(a) for a in columns["answer"]], list(completions))
        values = [None if c is None else float(c) for c in checked]
        return values, [c is None for c in checked]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]) -> list:
        return self.score_detailed(prompts, completions, **columns)[0]


# The think/answer layout: one think block, then one answer block, each tag once, any whitespace around the tags
# (so "<think>\n...\n</think>\n<answer>\n...\n</answer>" and "<think>...</think> <answer>...</answer>" both
# count: a model following either way of writing the usual system prompt gets the reward).
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_INSIDE = r"(?:(?!</?think>|</?answer>).)*"  # block content: any text but another tag
_FORMAT_RE = re.compile(rf"\s*<think>{_INSIDE}</think>\s*<answer>{_INSIDE}</answer>\s*", re.DOTALL)


def format_reward(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
    """1.0 when the whole completion is a think block followed by an answer block, else 0.0."""
    return [1.0 if _FORMAT_RE.fullmatch(c) else 0.0 for c in completions]


def tag_count_reward(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
    """0.25 for each of the four think/answer tags that appears exactly once (partial credit for the layout)."""
    return [sum(0.25 for tag in _TAGS if c.count(tag) == 1) for c in completions]


def verify_answers(golds: Sequence[str], completions: Sequence[str]) -> list[bool | None]:
    """math-verify in the shared worker pool, safe to call from custom reward functions (None = timed out)."""
    require("math_verify", "podsrl.rewards.verify_answers")
    return default_math_verify_pool().check(golds, completions)


BUILTINS: dict[str, str] = {
    "correct": "the task's verifier, or math-verify against the gold answer (1.0 / 0.0) of the last <answer> block, "
               "else the last \\boxed{}, else the last 2,000 characters",
    "format": "1.0 for a '<think>...</think><answer>...</answer>' completion (whitespace around tags free)",
    "tag_count": "0.25 per think/answer tag present exactly once",
}


def correct_reward(task: Task, pool: MathVerifyPool | None = None) -> RewardFn:
    """The `correct` built-in: the task's own verifier when it has one, math-verify otherwise."""
    if task.has_verifier():
        return TaskVerifierReward(task)
    if pool is None:  # checked here, at start-up: without it every worker would die and every reward be zero
        require("math_verify", f"the 'correct' reward of task {task.name!r} (math-verify against the gold answer)")
    return MathVerifyReward(pool)


def load_function(path: str) -> RewardFn:
    """Import "package.module:function" or "path/to/file.py:function"; ValueError/TypeError say what is wrong."""
    module_part, sep, attr = path.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(f"{path!r} is not of the form 'module:function' or 'file.py:function'")
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        file = Path(module_part).expanduser()
        if not file.is_file():
            raise ValueError(f"file {str(file)!r} not found")
        name = f"podsrl_user_rewards_{abs(hash(str(file.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {str(file)!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise ValueError(f"importing {str(file)!r} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as exc:
            raise ValueError(f"cannot import module {module_part!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{module_part!r} has no attribute {attr!r}")
    if not callable(fn):
        raise TypeError(f"{path!r} is not callable")
    return fn


# ---------------------------------------------------------------------------------------------------------------
# Manager


@dataclass
class RewardSpec:
    name: str
    weight: float
    fn: RewardFn


@dataclass
class RewardResult:
    rewards: torch.Tensor  # [R] float: weighted sum of components; NaN where valid is False
    components: dict[str, torch.Tensor]  # name -> [R] float, NaN where missing (skipped)
    correct: torch.Tensor  # [R] bool: `correct` component >= 0.5 (all False when no `correct` reward is set)
    valid: torch.Tensor  # [R] bool: False for rollouts a `skip` policy dropped
    metrics: dict[str, float] = field(default_factory=dict)
    has_correct: bool = True  # False: no reward named `correct`, so `correct` carries no information


def _spread_metrics(name: str, component: torch.Tensor) -> dict[str, float]:
    """Mean and std of a reward's values over the rows that have one."""
    finite = component[~component.isnan()]
    return {f"rewards/{name}/mean": float(finite.mean()) if finite.numel() else float("nan"),
            f"rewards/{name}/std": float(finite.std()) if finite.numel() > 1 else 0.0}


def merge_results(parts: list[tuple[list[int], RewardResult]]) -> RewardResult:
    """One result for the rows of several `score` calls, each given with the rows it scored, in row order: faults,
    invalid rollouts and times add up, each reward's mean and std are over all the rows."""
    order = torch.tensor([row for rows, _ in parts for row in rows], dtype=torch.long).argsort()
    results = [result for _, result in parts]

    def cat(values: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(values)[order]

    components = {name: cat([r.components[name] for r in results]) for name in results[0].components}
    metrics = {key: sum(r.metrics[key] for r in results) for key in results[0].metrics}
    for name, component in components.items():
        metrics.update(_spread_metrics(name, component))
    return RewardResult(cat([r.rewards for r in results]), components, cat([r.correct for r in results]),
                        cat([r.valid for r in results]), metrics, results[0].has_correct)


class _Fault(Exception):
    """One reward call went wrong as a whole (raised, timed out, wrong count)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _call_with_timeout(fn: RewardFn, timeout_s: float, args: tuple, kwargs: dict) -> Any:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="podsrl-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Fault("timeouts", f"did not return within {timeout_s:g} s")
    if "error" in box:
        exc = box["error"]
        raise _Fault("errors", f"raised {type(exc).__name__}: {exc}") from exc
    return box["value"]


def _to_float(value: Any) -> float | None:
    """A finite float, or None for None / non-numbers / NaN / inf (bools and numpy/torch scalars are numbers)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    out = float(value)
    return out if math.isfinite(out) else None


class RewardManager:
    """Scores a step's completions with every reward function and applies the fault policy."""

    def __init__(self, specs: list[RewardSpec], task: Task, on_error: str = "zero", timeout_s: float = 60.0,
                 max_faulty_calls: int = 5):
        if on_error not in ON_ERROR:
            raise ConfigError(f"rewards.on_error: {on_error!r} is not one of {', '.join(ON_ERROR)}")
        if not specs:
            raise ConfigError("rewards: at least one reward function is needed")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"rewards: duplicate reward names in {names}")
        self.specs, self.task, self.on_error, self.timeout_s = specs, task, on_error, float(timeout_s)
        self.max_faulty_calls = max_faulty_calls
        self._all_faulty_calls = dict.fromkeys(names, 0)  # consecutive calls with every value faulty
        self._warned: set[str] = set()
        self.has_correct = "correct" in names
        if not self.has_correct:
            logger.warning("no reward named 'correct': every rollout counts as incorrect for per-prompt "
                           "statistics and accuracy metrics")

    def _columns(self, problems: list[Problem], rows: list[int], environments: list | None) -> dict[str, list[Any]]:
        cols: dict[str, list[Any]] = {
            "answer": [problems[g].answer for g in rows],
            "problem_uid": [problems[g].uid for g in rows],
        }
        if environments is not None:
            cols[ENVIRONMENTS] = environments
        keys = {k for p in problems for k in p.metadata}
        for k in sorted(keys):
            if k in cols or k in ("prompts", "completions"):
                logger.warning("metadata column %r clashes with a reward argument and is not passed", k)
                continue
            cols[k] = [problems[g].metadata.get(k) for g in rows]
        return cols

    def _run(self, spec: RewardSpec, prompts: list[str], completions: list[str], cols: dict) -> tuple[list, list]:
        """(values with None where faulty, per-row fault kind or None). Whole-call faults raise _Fault."""
        n = len(completions)
        if getattr(spec.fn, "manages_own_timeout", False):
            try:
                raw, timed_out = spec.fn.score_detailed(prompts, completions, **cols)
            except Exception as exc:
                raise _Fault("errors", f"raised {type(exc).__name__}: {exc}") from exc
        else:
            raw = _call_with_timeout(spec.fn, self.timeout_s, (prompts, completions), cols)
            timed_out = [False] * n
        if isinstance(raw, torch.Tensor):
            raw = raw.tolist() if raw.dim() == 1 else raw
        elif hasattr(raw, "tolist") and getattr(raw, "ndim", 0) == 1:  # numpy arrays
            raw = raw.tolist()
        if not isinstance(raw, (list, tuple)):
            one = " (one value for the whole batch)" if _to_float(raw) is not None else ""
            raise _Fault("invalid", f"returned {type(raw).__name__}{one} instead of a list of {n} values, one per "
                         "completion")
        if len(raw) != n:
            one = " (one value for the whole batch)" if len(raw) == 1 else ""
            raise _Fault("invalid", f"returned {len(raw)} values{one} for {n} completions; return one per "
                         "completion")
        values = [None if t else _to_float(v) for v, t in zip(raw, timed_out)]
        kinds = ["timeouts" if t else ("invalid" if v is None else None) for v, t in zip(values, timed_out)]
        return values, kinds

    def score(self, problems: list[Problem], group_index: torch.Tensor, completions: list[str],
              environments: list | None = None) -> RewardResult:
        """`environments`: each row's episode environment, once over (None for single-turn completions); reward
        functions get them as the `environments` column, as TRL's do."""
        rows = [int(g) for g in group_index.tolist()]
        n = len(rows)
        if len(completions) != n or (environments is not None and len(environments) != n):
            raise ValueError(f"{len(completions)} completions and "
                             f"{n if environments is None else len(environments)} environments for {n} rollouts")
        prompts = [problems[g].prompt for g in rows]
        cols = self._columns(problems, rows, environments)
        valid = torch.ones(n, dtype=torch.bool)
        total = torch.zeros(n, dtype=torch.float64)
        components: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        for spec in self.specs:
            start = time.perf_counter()
            try:
                values, kinds = self._run(spec, prompts, completions, cols)
            except _Fault as fault:
                values, kinds = [None] * n, [fault.kind] * n
                detail = fault.detail
            else:
                detail = ""
            counts = {k: sum(1 for x in kinds if x == k) for k in ("errors", "timeouts", "invalid")}
            faulty = [i for i, k in enumerate(kinds) if k is not None]
            if faulty and self.on_error == "fail":
                self._raise(spec.name, detail, kinds, values, completions, problems, rows, faulty)
            fill = 0.0 if self.on_error == "zero" else float("nan")
            comp = torch.tensor([fill if v is None else v for v in values], dtype=torch.float64)
            if faulty and self.on_error == "skip":
                valid[faulty] = False
            if faulty:
                level = logging.DEBUG if spec.name in self._warned else logging.WARNING
                self._warned.add(spec.name)
                logger.log(level, "reward %r: %d of %d values faulty (%s)%s; reward_on_error=%s", spec.name,
                           len(faulty), n, ", ".join(f"{k}={v}" for k, v in counts.items() if v),
                           f": {detail}" if detail else "", self.on_error)
            self._check_streak(spec.name, n > 0 and len(faulty) == n, detail or
                               f"every value faulty ({', '.join(f'{k}={v}' for k, v in counts.items() if v)})")
            components[spec.name] = comp.float()
            total += spec.weight * torch.nan_to_num(comp, nan=0.0)
            metrics.update(_spread_metrics(spec.name, comp))
            for k, v in counts.items():
                metrics[f"rewards/{spec.name}/{k}"] = float(v)
            metrics[f"time/reward/{spec.name}"] = time.perf_counter() - start
        rewards = total.float()
        rewards[~valid] = float("nan")
        if self.has_correct:
            correct = (components["correct"] >= CORRECT_THRESHOLD) & valid  # NaN compares False
        else:
            correct = torch.zeros(n, dtype=torch.bool)
        metrics["rewards/invalid_rollouts"] = float((~valid).sum())
        return RewardResult(rewards, components, correct, valid, metrics, self.has_correct)

    def _check_streak(self, name: str, all_faulty: bool, detail: str) -> None:
        self._all_faulty_calls[name] = self._all_faulty_calls[name] + 1 if all_faulty else 0
        if self._all_faulty_calls[name] >= self.max_faulty_calls:
            raise UserError(f"reward function {name!r}: every value was faulty in {self._all_faulty_calls[name]} "
                            f"calls in a row (last: {detail}); fix the function (reward_max_faulty_calls="
                            f"{self.max_faulty_calls})")

    def _raise(self, name: str, detail: str, kinds: list, values: list, completions: list[str],
               problems: list[Problem], rows: list[int], faulty: list[int]) -> None:
        i = faulty[0]
        problem = problems[rows[i]]
        where = f"problem uid={problem.uid!r} (prompt {problem.prompt[:80]!r}, rollout {i})"
        if not detail:
            what = {"timeouts": "timed out", "invalid": "returned a value that is None, NaN, inf or not a number",
                    "errors": "failed"}[kinds[i]]
            detail = f"{what} for {len(faulty)} of {len(rows)} completions"
        raise UserError(f"reward function {name!r} {detail}; first affected: {where} "
                        f"(set rewards.on_error to 'zero' or 'skip' to continue past such faults)")


def build_reward_manager(
    entries: Sequence[dict | str] | None,
    task: Task,
    on_error: str = "zero",
    timeout_s: float = 60.0,
    pool: MathVerifyPool | None = None,
    max_faulty_calls: int = 5,
) -> RewardManager:
    """Reward functions from config entries: "name", "module:function", or {name, weight=1.0, function?}.

    With no entries the task's `default_rewards` are used. Errors name `rewards[i]`.
    """
    if not entries:
        entries = list(task.default_rewards)
    specs: list[RewardSpec] = []
    for i, entry in enumerate(entries):
        key = f"rewards[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry.rpartition(":")[2], "function": entry} if ":" in entry else {"name": entry}
        if not isinstance(entry, dict):
            raise ConfigError(f"{key}: expected a name or a mapping with name/weight/function, got {entry!r}")
        unknown = set(entry) - {"name", "weight", "function"}
        if unknown:
            raise ConfigError(f"{key}: unknown keys {sorted(unknown)} (allowed: name, weight, function)")
        name, function = entry.get("name"), entry.get("function")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}.name: a non-empty string is needed")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{key}.weight: expected a finite number, got {weight!r}")
        if function is not None:
            if not isinstance(function, str):
                raise ConfigError(f"{key}.function: expected 'module:function' or 'file.py:function'")
            try:
                fn = load_function(function)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{key}.function: {exc}") from exc
        elif name == "correct":
            fn = correct_reward(task, pool)
        elif name == "format":
            fn = format_reward
        elif name == "tag_count":
            fn = tag_count_reward
        else:
            raise ConfigError(f"{key}.name: unknown reward {name!r}; built-ins are {', '.join(BUILTINS)}, "
                              "or give function: 'module:function'")
        specs.append(RewardSpec(name, float(weight), fn))
    return RewardManager(specs, task, on_error=on_error, timeout_s=timeout_s, max_faulty_calls=max_faulty_calls)
