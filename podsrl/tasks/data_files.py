"""One reader for every data source a user brings: local .jsonl/.json/.csv/.parquet files or a Hugging Face
dataset by name. Each row comes with a label ("line 7", "row 3", "split 'train' row 9") so every error can name
the file and row. CSV files saved by Excel (UTF-8 with a byte-order mark) and JSON files with a BOM read as
expected; parquet and hub datasets need the `tasks` extra.
"""

from __future__ import annotations

import csv
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from podsrl.errors import DataError
from podsrl.extras import require

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_LINE_BYTES = 10 * 1024 * 1024  # a line longer than this is almost certainly not one problem
BOM = "\ufeff"


def _read_jsonl(path: Path, max_line_bytes: int) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        head = f.read(8).decode("utf-8", errors="ignore").lstrip(BOM + " \t\r\n")
        if path.suffix == ".json" and head.startswith("["):  # a JSON array of objects
            f.seek(0)
            try:
                rows = json.loads(f.read().decode("utf-8-sig"))
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
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
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
    # csv's field limit is process-wide (importlib.metadata reads RECORD files with it): set it for this file only
    previous = csv.field_size_limit(max_line_bytes)
    try:
        yield from _csv_rows(path)
    finally:
        csv.field_size_limit(previous)


def _csv_rows(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is dropped instead of becoming part of the first
        # column's name
        with open(path, encoding="utf-8-sig", newline="") as f:
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
    require("pyarrow", f"reading {path.name} (parquet)")
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
    require("datasets", f"the Hugging Face dataset {name!r}")
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
    """All rows of a local file (by suffix) or a hub dataset (anything else), each with its label."""
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
