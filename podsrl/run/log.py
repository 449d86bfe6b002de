"""`<run>/run.log`: the podsrl log lines of every attempt of a run, appended, with times.

A scheduler's own output file is often per job attempt (a requeued SLURM job truncates it by default), so the
warnings that matter later (checkpoints skipped on resume, health checks, a lock taken over) are kept in the run
directory too. Only the lock holder writes it.
"""

from __future__ import annotations

import logging
from pathlib import Path

LOG_FILE = "run.log"

_logger = logging.getLogger("podsrl")


class RunLog:
    def __init__(self, run_dir: str | Path) -> None:
        self.handler = logging.FileHandler(Path(run_dir) / LOG_FILE, mode="a", encoding="utf-8")
        self.handler.setLevel(logging.INFO)
        self.handler.setFormatter(logging.Formatter("%(asctime)s pid %(process)d %(levelname)s %(message)s"))
        _logger.addHandler(self.handler)
        self._level = _logger.level
        if _logger.getEffectiveLevel() > logging.INFO:  # a library user without logging set up still gets the file
            _logger.setLevel(logging.INFO)

    def close(self) -> None:
        _logger.removeHandler(self.handler)
        _logger.setLevel(self._level)
        self.handler.close()
