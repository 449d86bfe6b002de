"""Procedurally generated tasks from reasoning-gym, scored by each dataset's own `score_answer`.

The answer given to `score_answer` is taken from the completion as follows: the content of the last
<answer>...</answer> block when there is one, otherwise the last non-empty line. Prompts should therefore ask
for <answer> tags (`SYSTEM_PROMPT` below is reasoning-gym's default instruction).

Some datasets give partial credit (a score strictly between 0 and 1). The `correct` reward carries the score
as is, while the correctness bit used by per-prompt statistics and accuracy is `score >= 0.5`; the first
partial score seen is reported with a warning so the thresholding is not a surprise.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from podsrl.batch import Problem
from podsrl.errors import ConfigError
from podsrl.extras import require
from podsrl.tasks.base import Task, construct, pop_prompt_formatter
from podsrl.tasks.datasets import epoch_permutation

logger = logging.getLogger("podsrl")

SYSTEM_PROMPT = (
    "Given a problem, your task is to answer the question by thinking step-by-step in a clear and specific "
    "manner.\nOnce you have thought about the reasoning process, provide the answer in the following format:\n"
    "<answer>answer here</answer>\nDo not explain your reasoning inside the answer tags, provide only the final "
    "answer."
)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
EVAL_SEED_OFFSET = 1_000_003  # eval problems come from a differently seeded generator


def extract_completion_answer(completion: str) -> str:
    """The last <answer>...</answer> content, else the last non-empty line (stripped); "" for an empty text."""
    blocks = _ANSWER_RE.findall(completion)
    if blocks:
        return blocks[-1].strip()
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _create(name: str, size: int, seed: int, params: dict[str, Any]) -> Any:
    require("reasoning_gym", f"the reasoning_gym task {name!r}")
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **params)
    except ValueError as exc:
        if "not registered" in str(exc):
            raise ConfigError(f"task.name: unknown reasoning-gym dataset {name!r}") from exc
        raise ConfigError(f"task.params for reasoning-gym {name!r}: {exc}") from exc
    except (TypeError, AssertionError) as exc:  # unknown keyword / failed config validation
        raise ConfigError(f"task.params for reasoning-gym {name!r}: {exc or type(exc).__name__}") from exc


class ReasoningGymTask(Task):
    """`size` training problems (revisited in reshuffled epochs) and `eval_size` held-out ones.

    Eval problems come from the same generator with another seed; any whose question also appears among the
    training problems is dropped, so the eval set can be slightly smaller than `eval_size`.
    """

    default_rewards = ("correct",)

    @classmethod
    def from_config(cls, cfg, tokenizer=None) -> ReasoningGymTask:
        args = dict(cfg.args)
        formatter = pop_prompt_formatter(args, tokenizer)
        if "name" not in args:
            raise ConfigError("task.args.name: a reasoning_gym task needs a dataset name (e.g. chain_sum)")
        return construct(cls, cfg.name, args.pop("name"), seed=cfg.seed, eval_size=cfg.eval_size,
                         format_prompt=formatter, **args)

    def __init__(
        self,
        name: str,
        size: int = 10_000,
        seed: int = 0,
        eval_size: int = 100,
        format_prompt: Callable[[str], str] | None = None,
        **params: Any,
    ) -> None:
        if size < 1 or eval_size < 0:
            raise ConfigError(f"task: size must be >= 1 and eval_size >= 0, got {size} and {eval_size}")
        self.name = f"reasoning_gym:{name}"
        self.dataset_name, self.size, self.seed = name, int(size), int(seed)
        self._format = format_prompt or (lambda q: q)
        self._train = _create(name, self.size, self.seed, params)
        self._eval_ds = _create(name, max(eval_size, 1), self.seed + EVAL_SEED_OFFSET, params)
        self._eval_size = int(eval_size)
        self._entries: dict[str, dict[str, Any]] = {}  # uid -> reasoning-gym entry, for score_answer
        self._cache: dict[int, Problem] = {}
        self._eval: list[Problem] | None = None
        self._perm_epoch, self._perm = -1, None
        self._limited: list[Problem] | None = None  # the training problems after a prompt-length limit
        self.partial_credit_seen = False

    def _problem(self, ds: Any, index: int, kind: str) -> Problem:
        entry = ds[index]
        uid = f"{self.dataset_name}:{kind}:{self.seed}:{index}"
        self._entries[uid] = entry
        return Problem(uid=uid, prompt=self._format(entry["question"]), answer=str(entry["answer"]),
                       metadata=dict(entry.get("metadata") or {}))

    def __len__(self) -> int:
        return self.size if self._limited is None else len(self._limited)

    def problem(self, index: int) -> Problem:
        epoch, pos = divmod(int(index), len(self))
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = epoch_permutation(len(self), self.seed, epoch), epoch
        row = int(self._perm[pos])
        if self._limited is not None:
            return self._limited[row]
        if row not in self._cache:
            self._cache[row] = self._problem(self._train, row, "train")
        return self._cache[row]

    def eval_set(self) -> list[Problem]:
        if self._eval is None:
            train_questions = {self._train[i]["question"] for i in range(self.size)}
            out = [self._problem(self._eval_ds, i, "eval") for i in range(self._eval_size)]
            kept = [p for p in out if self._entries[p.uid]["question"] not in train_questions]
            if len(kept) < len(out):
                logger.info("reasoning-gym %s: %d eval problems also occur in training and were dropped",
                            self.dataset_name, len(out) - len(kept))
            self._eval = kept
        return list(self._eval)

    def limit_prompts(self, rule) -> dict[str, tuple[int, int]]:
        """Apply a podsrl.tasks.prompt_length.PromptLimit to every training and eval problem (generated now);
        (filtered, truncated) counts of each."""
        where = f"reasoning-gym {self.dataset_name}"
        train = [self._problem(self._train, i, "train") for i in range(self.size)]
        kept, _, *train_counts = rule.apply(train, [f"{where}: training problem {i}" for i in range(self.size)])
        if not kept:
            raise ConfigError(f"task: every {where} prompt is longer than {rule.max_tokens} tokens "
                              "(task.max_prompt_length)")
        held = self.eval_set()
        self._eval, _, *eval_counts = rule.apply(held, [f"{where}: eval problem {i}" for i in range(len(held))])
        self._limited, self._perm_epoch = kept, -1
        return {"train": tuple(train_counts), "eval": tuple(eval_counts)}

    def _entry(self, problem: Problem) -> dict[str, Any]:
        entry = self._entries.get(problem.uid)
        if entry is None:  # a problem this instance did not generate: rebuild what score_answer reads
            entry = {"question": problem.prompt, "answer": problem.answer, "metadata": dict(problem.metadata)}
        return entry

    def score(self, completion: str, problem: Problem) -> float:
        try:
            value = float(self._train.score_answer(extract_completion_answer(completion), self._entry(problem)))
        except Exception:  # a model answer the scorer chokes on is a wrong answer
            logger.debug("reasoning-gym %s: score_answer failed", self.dataset_name, exc_info=True)
            return 0.0
        if 0.0 < value < 1.0 and not self.partial_credit_seen:
            self.partial_credit_seen = True
            logger.warning("reasoning-gym %s gives partial credit (score %.3g seen): the `correct` reward keeps "
                           "the score, but a rollout counts as correct only at >= 0.5", self.dataset_name, value)
        return value

    def is_correct(self, completion: str, problem: Problem) -> bool:
        return self.score(completion, problem) >= 0.5

    def reference_completion(self, problem: Problem) -> str:
        return f"<answer>{problem.answer}</answer>"
