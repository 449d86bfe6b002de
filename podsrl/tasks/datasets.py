"""Dataset tasks: prompts and gold answers from local jsonl / parquet / csv files or Hugging Face datasets.

Every row is validated when the task is built, so a bad file fails at start-up with the file and row named,
not in the middle of a run. Training order: problem(i) = row permutation_epoch[i mod N] with epoch = i // N, the
permutation seeded by (seed, epoch), so a run's data position is a single integer and resume is exact.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from podsrl.answers import extract_boxed
from podsrl.batch import Problem
from podsrl.errors import ConfigError, DataError
from podsrl.tasks.base import Task, construct, pop_prompt_formatter, with_eval_set
from podsrl.tasks.data_files import MAX_LINE_BYTES, read_rows

log = logging.getLogger("podsrl")

ANSWER_FORMATS = ("raw", "gsm8k", "boxed", "auto")
PROMPT_COLUMNS = ("prompt", "question", "problem", "input", "query")
ANSWER_COLUMNS = ("answer", "solution", "target", "output", "gold")
_NUMBER = re.compile(r"^[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?$")


# ---------------------------------------------------------------------------------------------------------------
# answer extraction


def extract_gsm8k(text: str) -> str | None:
    """GSM8K solutions end with '#### 1,234': the text after the last '####', thousands separators stripped."""
    if "####" not in text:
        return None
    out = text.rsplit("####", 1)[1].strip().replace(",", "")
    return out or None


def numeric_answer(value: Any) -> str | None:
    """A gold answer that is just a number, normalised: an int/float cell (42, 42.0 -> "42") or a text such as
    "1,234" -> "1234". None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    text = str(value).strip()
    return text.replace(",", "") if _NUMBER.match(text) else None


def extract_answer(text: str, answer_format: str) -> str | None:
    """The gold answer from a solution text; `auto` tries '####', then \\boxed, then takes the text as is."""
    if answer_format == "raw":
        return text.strip() or None
    if answer_format == "gsm8k":
        return extract_gsm8k(text)
    if answer_format == "boxed":
        return extract_boxed(text)
    if answer_format == "auto":
        if "####" in text:
            return extract_gsm8k(text)
        if "\\boxed" in text or "\\fbox" in text:
            return extract_boxed(text)
        return text.strip() or None
    raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")


# ---------------------------------------------------------------------------------------------------------------
# the task


def prompt_uid(text: str) -> str:
    """Stable id of a prompt: the same text gives the same uid in every run and process."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _mix(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"podsrl:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The row order of training epoch `epoch`: a permutation of range(n) seeded by (seed, epoch) only."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(_mix(seed, epoch)))


class DatasetTask(Task):
    """Problems from a dataset, with a column mapping and gold-answer extraction.

    source: a local .jsonl/.json/.parquet/.csv path, or a Hugging Face dataset name (with `config`).
    prompt_column / answer_column: None picks the first present of PROMPT_COLUMNS / ANSWER_COLUMNS.
    id_column: a column to use as uid (else a hash of the question text). Other columns go to metadata.
    answer_format: raw | gsm8k | boxed | auto (see `extract_answer`) for text answers; a number cell is the answer.
    Eval set: `eval_path` (a local file, or a hub dataset read with split `eval_split`, default "test", and
    `eval_config`), else `eval_split` of the training dataset (with a local training file: the eval file's path),
    else `eval_fraction` of the distinct questions held out by seed, else none; at most `eval_limit` of them. Eval
    questions never occur in training: a question held out is held out with all its duplicates, and eval_split /
    eval_path questions that also occur in training are dropped.
    format_prompt: turns a question into the text given to the tokenizer (see podsrl.tasks.templates).
    No verifier of its own: the `correct` reward checks answers with math-verify.
    """

    default_rewards = ("correct",)

    @classmethod
    def from_config(cls, cfg, tokenizer=None) -> DatasetTask:
        args = dict(cfg.args)
        formatter = pop_prompt_formatter(args, tokenizer)
        if "path" not in args:
            raise ConfigError("task.args.path: a dataset task needs a file path or a Hugging Face dataset name")
        return construct(cls, cfg.name, args.pop("path"), seed=cfg.seed, format_prompt=formatter,
                         **with_eval_set(args, cfg))

    def __init__(
        self,
        source: str,
        *,
        config: str | None = None,
        split: str = "train",
        prompt_column: str | None = None,
        answer_column: str | None = None,
        id_column: str | None = None,
        answer_format: str = "auto",
        eval_split: str | None = None,
        eval_path: str | None = None,
        eval_config: str | None = None,
        eval_fraction: float = 0.0,
        eval_limit: int | None = None,
        seed: int = 0,
        format_prompt: Callable[[str], str] | None = None,
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        if answer_format not in ANSWER_FORMATS:
            raise DataError(f"answer_format: {answer_format!r} is not one of {', '.join(ANSWER_FORMATS)}")
        if (eval_split is not None or eval_path is not None) and eval_fraction:
            raise DataError("give either eval_split / eval_path or eval_fraction, not both")
        if not 0.0 <= eval_fraction < 1.0:
            raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        self.name = f"dataset:{Path(source).name or source}"
        self.source, self.seed = source, int(seed)
        self._columns = (prompt_column, answer_column, id_column, answer_format)
        self._format = format_prompt or (lambda q: q)
        train, train_labels = self._problems(source, read_rows(source, split, config, max_line_bytes))
        if eval_split is not None or eval_path is not None:
            eval_src, rows = self._eval_rows(eval_path, eval_split, eval_config, config, max_line_bytes)
            held, held_labels = self._problems(eval_src, rows)
            seen = {p.prompt for p in train}
            kept = [(p, lab) for p, lab in zip(held, held_labels) if p.prompt not in seen]
            if len(kept) < len(held):
                log.info("dataset %s: %d eval questions of %s also occur in training and were dropped",
                         Path(source).name, len(held) - len(kept), eval_src)
            held, held_labels = [p for p, _ in kept], [lab for _, lab in kept]
            log.info("dataset %s: evaluating on %d of the %d eval problems of %s (task.eval_size=%s%s)",
                     Path(source).name, len(held[:eval_limit]), len(held), eval_src, eval_limit,
                     ", more than there are" if eval_limit is not None and eval_limit > len(held) else "")
        elif eval_fraction:
            train, train_labels, held, held_labels = self._hold_out(train, train_labels, eval_fraction, eval_limit)
        else:
            held, held_labels = [], []
        self.train_problems, self._train_labels = train, train_labels
        self._eval, self._eval_labels = held[:eval_limit], held_labels[:eval_limit]
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _eval_rows(self, eval_path: str | None, eval_split: str | None, eval_config: str | None,
                   config: str | None, max_line_bytes: int) -> tuple[str, list[tuple[str, dict]]]:
        """(source, rows) of the eval set given by eval_path or eval_split (see the class docstring)."""
        if eval_path is not None:
            try:
                return eval_path, read_rows(eval_path, eval_split or "test", eval_config, max_line_bytes)
            except DataError as exc:
                raise DataError(f"task.args.eval_path: {exc}") from None
        if Path(self.source).expanduser().exists():
            if not Path(eval_split).expanduser().is_file():
                raise DataError(f"eval_split {eval_split!r}: file not found (with a local dataset file, "
                                "eval_split is the path of the eval file; or give task.args.eval_path)")
            return eval_split, read_rows(eval_split, eval_split, config, max_line_bytes)
        return self.source, read_rows(self.source, eval_split, config, max_line_bytes)

    def _hold_out(self, train: list[Problem], labels: list[str], fraction: float, limit: int | None):
        """Hold out ceil(fraction * distinct questions) of them (at most `limit`), chosen by the seed alone; a
        question that occurs several times is held out with all its copies (one of them is evaluated)."""
        questions = list(dict.fromkeys(p.prompt for p in train))  # distinct, in file order
        k = min(math.ceil(fraction * len(questions)), limit if limit is not None else len(questions))
        if k < 1 or k >= len(questions):
            log.warning("dataset %s: %d distinct questions are too few to hold out an eval set "
                        "(task.eval_fraction=%g); training without evaluation", self.source, len(questions), fraction)
            return train, labels, [], []
        order = epoch_permutation(len(questions), self.seed, -1)  # "epoch -1": never a training order
        held = {questions[int(i)] for i in order[:k]}
        rest = [(p, lab) for p, lab in zip(train, labels) if p.prompt not in held]
        first: dict[str, tuple[Problem, str]] = {}
        for p, lab in zip(train, labels):
            if p.prompt in held:
                first.setdefault(p.prompt, (p, lab))
        log.info("dataset %s: no eval_split given, so %d of %d distinct questions (task.eval_fraction=%g, seed %d) "
                 "are held out for evaluation and never trained on", Path(self.source).name, k, len(questions),
                 fraction, self.seed)
        evals = list(first.values())
        return [p for p, _ in rest], [lab for _, lab in rest], [p for p, _ in evals], [lab for _, lab in evals]

    def _problems(self, source: str, rows: list[tuple[str, dict]]) -> tuple[list[Problem], list[str]]:
        prompt_col, answer_col, id_col, fmt = self._columns
        columns = list(rows[0][1].keys())
        prompt_col = prompt_col or next((c for c in PROMPT_COLUMNS if c in columns), None)
        answer_col = answer_col or next((c for c in ANSWER_COLUMNS if c in columns), None)
        if prompt_col is None or answer_col is None:
            which = "prompt" if prompt_col is None else "answer"
            raise DataError(f"{source}: no {which} column found among {columns}; set the {which} column "
                            f"(looked for {PROMPT_COLUMNS if which == 'prompt' else ANSWER_COLUMNS})")
        out, labels = [], []
        for label, row in rows:
            where = f"{source}: {label}"
            for col in (prompt_col, answer_col, id_col):
                if col is not None and col not in row:
                    raise DataError(f"{where}: no column {col!r} (columns: {', '.join(map(str, row))})")
            question, answer = row[prompt_col], row[answer_col]
            if not isinstance(question, str) or not question.strip():
                raise DataError(f"{where}: column {prompt_col!r} must be non-empty text, got "
                                f"{type(question).__name__} {str(question)[:40]!r}")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise DataError(f"{where}: column {answer_col!r} must be text or a number, got "
                                f"{type(answer).__name__}")
            if isinstance(answer, float) and not math.isfinite(answer):
                raise DataError(f"{where}: column {answer_col!r} is {answer!r}, not an answer")
            if isinstance(answer, str):  # "1,234" as a whole answer is the number 1234
                gold = extract_answer(answer, fmt)
                gold = (numeric_answer(gold) or gold) if gold is not None else None
            else:  # a number cell (jsonl / parquet) is the answer whatever the format: 42.0 -> "42"
                gold = numeric_answer(answer)
            if gold is None:
                raise DataError(f"{where}: no answer found in column {answer_col!r} with answer_format {fmt!r} "
                                f"({str(answer)[-60:]!r})")
            uid = str(row[id_col]) if id_col is not None else prompt_uid(question)
            meta = {k: v for k, v in row.items() if k not in (prompt_col, answer_col, id_col)}
            out.append(Problem(uid=uid, prompt=self._format(question), answer=gold, metadata=meta))
            labels.append(where)
        return out, labels

    def limit_prompts(self, rule) -> dict[str, tuple[int, int]]:
        """Apply a podsrl.tasks.prompt_length.PromptLimit to the training and eval problems; (filtered,
        truncated) counts of each."""
        self.train_problems, self._train_labels, *train = rule.apply(self.train_problems, self._train_labels)
        if not self.train_problems:
            raise DataError(f"{self.source}: every training prompt is longer than {rule.max_tokens} tokens "
                            "(task.max_prompt_length)")
        self._eval, self._eval_labels, *held = rule.apply(self._eval, self._eval_labels)
        self._perm_epoch = -1
        return {"train": tuple(train), "eval": tuple(held)}

    def __len__(self) -> int:
        return len(self.train_problems)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The row order of training epoch `epoch` (seeded by (seed, epoch); the last one is cached)."""
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = epoch_permutation(len(self.train_problems), self.seed, epoch), epoch
        return self._perm

    def problem(self, index: int) -> Problem:
        n = len(self.train_problems)
        epoch, pos = divmod(int(index), n)
        return self.train_problems[int(self.permutation(epoch)[pos])]

    def eval_set(self) -> list[Problem]:
        return list(self._eval)
