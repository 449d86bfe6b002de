"""Small file helpers shared by config dumps, metrics rewrites and run summaries."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace `path` whole: a kill mid-write leaves the old file, never a torn one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
