"""A Hugging Face model directory's safetensors, read one tensor at a time with plain file reads.

Used where a whole model must never be in memory at once (rank 0 loading straight into FSDP2's shards:
podsrl/models/sharded_loading.py). The safetensors library maps the file and copies out of the mapping; the pages it
touched stay in the process's resident set while the file is open, so a model read through it counts whole in the
reader's memory. Here each tensor's bytes go from the file into the tensor's own storage, nothing else is mapped, and
the format's header is all that is parsed: 8 bytes of little-endian header length, then a JSON object of name ->
{dtype, shape, data_offsets} (offsets into the data that follows the header).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsDirectory:
    """The tensors of `directory` (model.safetensors, or the shards model.safetensors.index.json names)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [SINGLE]
        self.entries: dict[str, tuple[Path, int, dict]] = {}  # name -> (file, data start, header entry)
        for name in files:
            path = self.directory / name
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            for key, entry in header.items():
                self.entries[key] = (path, 8 + length, entry)
        self._open: dict[Path, BinaryIO] = {}

    @classmethod
    def holds_weights(cls, directory: str | Path) -> bool:
        return (Path(directory) / INDEX).is_file() or (Path(directory) / SINGLE).is_file()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][2]["shape"])

    def dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype (None: one this reader does not know)."""
        return DTYPES.get(self.entries[name][2]["dtype"])

    def read(self, name: str) -> torch.Tensor:
        """The tensor as stored (its dtype and shape), read into memory of its own."""
        path, start, entry = self.entries[name]
        begin, end = entry["data_offsets"]
        tensor = torch.empty(entry["shape"], dtype=self.dtype(name))
        f = self._open.get(path) or self._open.setdefault(path, open(path, "rb"))  # noqa: SIM115 - closed in close()
        f.seek(start + begin)
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        if end - begin != len(view) or f.readinto(view) != len(view):
            raise OSError(f"{path}: tensor {name} is truncated or its header is wrong")
        return tensor

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
