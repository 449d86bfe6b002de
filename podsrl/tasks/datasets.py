"""Dataset tasks: prompts and gold answers from local jsonl / parquet / csv files or Hugging Face datasets.

Every row is validated when the task is built, so a bad file fails at start-up with the file and row named,
not in the middle of a run. Training order: problem(i) = row permutation_epoch[i mod N] with epoch = i // N, the
permutation seeded by (seed, epoch), so a run's data position is a single integer and resume is exact.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from podsrl.batch import Problem
from podsrl.errors import DataError
from podsrl.tasks.base import Task

ANSWER_FORMATS = ("raw", "gsm8k", "boxed", "auto")
PROMPT_COLUMNS = ("prompt", "question", "problem", "input", "query")
ANSWER_COLUMNS = ("answer", "solution", "target", "output", "gold")
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_LINE_BYTES = 10 * 1024 * 1024  # a line longer than this is almost certainly not one problem


# ---------------------------------------------------------------------------------------------------------------
# answer extraction


def extract_gsm8k(text: str) -> str | None:
    """GSM8K solutions end with '#### 1,234': the text after the last '####', thousands separators stripped."""
    if "####" not in text:
        return None
    out = text.rsplit("####", 1)[1].strip().replace(",", "")
    return out or None


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces matched; None if there is none
    or its braces never close."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip() or None
    return None


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
# readers: each yields (row label for messages, row dict)


def _read_jsonl(path: Path, max_line_bytes: int) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        if path.suffix == ".json" and f.read(1).lstrip() == b"[":  # a JSON array of objects
            f.seek(0)
            try:
                rows = json.loads(f.read().decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise DataError(f"{path}: not a valid UTF-8 JSON file ({exc})") from exc
            for i, row in enumerate(rows):
                yield f"row {i}", _must_be_object(row, path, f"row {i}")
            return
        f.seek(0)
        lineno = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > max_line_bytes:
                raise DataError(f"{path}: line {lineno} is longer than {max_line_bytes} bytes; "
                                "is this a JSON-lines file with one problem per line?")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: line {lineno} is not valid UTF-8 ({exc.reason} at byte {exc.start})") \
                    from exc
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {lineno} is not valid JSON ({exc.msg})") from exc
            yield f"line {lineno}", _must_be_object(row, path, f"line {lineno}")


def _must_be_object(row: Any, path: Path, label: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{path}: {label} is a JSON {type(row).__name__}, expected an object with named fields")
    return row


def _read_csv(path: Path, max_line_bytes: int) -> Iterator[tuple[str, dict]]:
    csv.field_size_limit(max_line_bytes)
    try:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            try:
                for row in reader:
                    if None in row:
                        raise DataError(f"{path}: line {reader.line_num} has more fields than the header")
                    yield f"line {reader.line_num}", row
            except csv.Error as exc:
                raise DataError(f"{path}: line {reader.line_num + 1}: {exc}") from exc  # the line being read
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc


def _read_parquet(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:
        raise DataError(f"{path}: cannot read as parquet ({type(exc).__name__}: {exc})") from exc
    for i, row in enumerate(rows):
        yield f"row {i}", row


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """A quick TCP probe of the hub, so an offline machine gets a clear error instead of minutes of retries.
    With a proxy configured the probe proves nothing, so it is skipped (assume reachable)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return True
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


@contextmanager
def _offline() -> Iterator[None]:
    """Use only the local Hugging Face cache for the duration (no network retries)."""
    import datasets.config as dc
    import huggingface_hub.constants as hc

    saved = dc.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE
    dc.HF_HUB_OFFLINE = hc.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dc.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE = saved


def _read_hub(name: str, config: str | None, split: str) -> Iterator[tuple[str, dict]]:
    import datasets

    reachable = _hub_reachable()
    try:
        if reachable:
            ds = datasets.load_dataset(name, config, split=split)
        else:
            with _offline():
                ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        where = "not found locally and the hub is unreachable" if not reachable else \
            "could not be loaded from the hub"
        raise DataError(f"dataset {name!r}: {where} ({type(exc).__name__}: {str(exc)[:300]}); give a local "
                        "jsonl/parquet/csv path, or check the name, config and split") from exc
    for i, row in enumerate(ds):
        yield f"split {split!r} row {i}", row


def read_rows(source: str, split: str = "train", config: str | None = None,
              max_line_bytes: int = MAX_LINE_BYTES) -> list[tuple[str, dict]]:
    """All rows of a local file (by suffix) or a hub dataset (anything else), with labels for messages."""
    path = Path(source).expanduser()
    kind = LOCAL_SUFFIXES.get(path.suffix.lower())
    if path.is_dir():
        raise DataError(f"{path}: is a directory; give a .jsonl, .json, .parquet or .csv file")
    if kind is None and not path.exists():
        return list(_read_hub(source, config, split))
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    if kind is None:
        raise DataError(f"{path}: unknown file type {path.suffix!r}; use .jsonl, .json, .parquet or .csv")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: file is empty")
    if kind == "json":
        rows = list(_read_jsonl(path, max_line_bytes))
    elif kind == "csv":
        rows = list(_read_csv(path, max_line_bytes))
    else:
        rows = list(_read_parquet(path))
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


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
    answer_format: raw | gsm8k | boxed | auto (see `extract_answer`).
    Eval set: `eval_split` (a hub split name or a local file) or `eval_fraction` of the rows held out by seed;
    neither gives an empty eval set. `eval_limit` keeps the first k eval problems.
    format_prompt: turns a question into the text given to the tokenizer (see podsrl.tasks.templates).
    No verifier of its own: the `correct` reward checks answers with math-verify.
    """

    default_rewards = ("correct",)

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
        eval_fraction: float = 0.0,
        eval_limit: int | None = None,
        seed: int = 0,
        format_prompt: Callable[[str], str] | None = None,
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        if answer_format not in ANSWER_FORMATS:
            raise DataError(f"answer_format: {answer_format!r} is not one of {', '.join(ANSWER_FORMATS)}")
        if eval_split is not None and eval_fraction:
            raise DataError("give either eval_split or eval_fraction, not both")
        if not 0.0 <= eval_fraction < 1.0:
            raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        self.name = f"dataset:{Path(source).name or source}"
        self.source, self.seed = source, int(seed)
        self._columns = (prompt_column, answer_column, id_column, answer_format)
        self._format = format_prompt or (lambda q: q)
        train = self._problems(source, read_rows(source, split, config, max_line_bytes))
        if eval_split is not None:
            local = Path(source).expanduser().exists()
            if local and not Path(eval_split).expanduser().is_file():
                raise DataError(f"eval_split {eval_split!r}: file not found (with a local dataset file, "
                                "eval_split is the path of the eval file)")
            eval_src = eval_split if local else source
            eval_problems = self._problems(eval_src, read_rows(eval_src, eval_split, config, max_line_bytes))
        elif eval_fraction:
            order = epoch_permutation(len(train), self.seed, -1)  # "epoch -1": never a training order
            k = max(1, math.ceil(eval_fraction * len(train)))
            held = set(order[:k].tolist())
            if k >= len(train):
                raise DataError(f"{source}: eval_fraction {eval_fraction} leaves no training rows")
            eval_problems = [p for i, p in enumerate(train) if i in held]
            train = [p for i, p in enumerate(train) if i not in held]
        else:
            eval_problems = []
        self.train_problems = train
        self._eval = eval_problems[:eval_limit] if eval_limit is not None else eval_problems
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _problems(self, source: str, rows: list[tuple[str, dict]]) -> list[Problem]:
        prompt_col, answer_col, id_col, fmt = self._columns
        columns = list(rows[0][1].keys())
        prompt_col = prompt_col or next((c for c in PROMPT_COLUMNS if c in columns), None)
        answer_col = answer_col or next((c for c in ANSWER_COLUMNS if c in columns), None)
        if prompt_col is None or answer_col is None:
            which = "prompt" if prompt_col is None else "answer"
            raise DataError(f"{source}: no {which} column found among {columns}; set the {which} column "
                            f"(looked for {PROMPT_COLUMNS if which == 'prompt' else ANSWER_COLUMNS})")
        out = []
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
            gold = extract_answer(str(answer), fmt)
            if gold is None:
                raise DataError(f"{where}: no answer found in column {answer_col!r} with answer_format {fmt!r} "
                                f"({str(answer)[-60:]!r})")
            uid = str(row[id_col]) if id_col is not None else prompt_uid(question)
            meta = {k: v for k, v in row.items() if k not in (prompt_col, answer_col, id_col)}
            out.append(Problem(uid=uid, prompt=self._format(question), answer=gold, metadata=meta))
        return out

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
