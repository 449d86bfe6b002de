"""`<run>/run.log`: the podsrl log lines of every attempt of a run, appended, with times.

A scheduler's own output file is often per job attempt (a requeued SLURM job truncates it by default), so the
warnings that matter later (checkpoints skipped on resume, health checks, a lock taken over) are kept in the run
directory too. Only the lock holder writes it. Under torchrun the other ranks print warnings and errors only;
`log.rank_logs` gives each of them its own `<run>/ranks/rank<N>.log` with all its lines (RankLog).
"""

from __future__ import annotations

import logging
from pathlib import Path

from podsrl.reporting.streams import PROGRESS, lost_streams, warn_lost

LOG_FILE = "run.log"
RANK_LOG_DIR = "ranks"
FORMAT = "%(asctime)s pid %(process)d %(levelname)s %(message)s"

_logger = logging.getLogger("podsrl")


class RunLog:
    def __init__(self, run_dir: str | Path) -> None:
        self.handler = logging.FileHandler(Path(run_dir) / LOG_FILE, mode="a", encoding="utf-8")
        self.handler.setLevel(logging.INFO)
        self.handler.setFormatter(logging.Formatter(FORMAT))
        _logger.addHandler(self.handler)
        PROGRESS.addHandler(self.handler)  # progress lines that stdout no longer takes
        self._level = _logger.level
        if _logger.getEffectiveLevel() > logging.INFO:  # a library user without logging set up still gets the file
            _logger.setLevel(logging.INFO)
        for stream in lost_streams():  # lost before this file was open: said again here, where it is kept
            warn_lost(stream)

    def close(self) -> None:
        _logger.removeHandler(self.handler)
        PROGRESS.removeHandler(self.handler)
        _logger.setLevel(self._level)
        self.handler.close()


class RankLog:
    """A rank other than 0 (log.rank_logs): every podsrl line of this rank, INFO and up, appended to
    `<run>/ranks/rank<N>.log`, while the console keeps getting its warnings and errors only."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        directory = Path(run_dir) / RANK_LOG_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self.handler = logging.FileHandler(directory / f"rank{rank}.log", mode="a", encoding="utf-8")
        self.handler.setFormatter(logging.Formatter(FORMAT))
        self._level = _logger.level
        self._console = [h for h in logging.getLogger().handlers + _logger.handlers if h is not self.handler]
        for handler in self._console:
            handler.addFilter(_warnings_only)
        _logger.addHandler(self.handler)
        _logger.setLevel(logging.INFO)

    def close(self) -> None:
        _logger.removeHandler(self.handler)
        for handler in self._console:
            handler.removeFilter(_warnings_only)
        _logger.setLevel(self._level)
        self.handler.close()


def _warnings_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not record.name.startswith("podsrl")
