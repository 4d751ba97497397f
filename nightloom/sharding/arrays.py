"""Fixed-dtype work arrays (per-document hashes and sizes, per-document shard) as raw little-endian files,
written and read in order, a chunk at a time, so no step holds a whole input's arrays in memory.

Not .npy: numpy reads an .npy header with ast.literal_eval, and on CPython 3.11.7 concurrent parses in threads
fail with "AST constructor recursion depth mismatch" (gh-106905); shard writers run in threads. The dtype is
fixed by the caller, so the file needs no header. A writer publishes with os.replace (readers never see a
partial file); a reader checks that the file holds whole records and that it got as many as it asked for.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import numpy as np

DEST_DTYPE = np.dtype("<i4")  # shard index per spilled document, -1 = dropped duplicate
CHUNK_RECORDS = 1 << 18  # records per chunk when streaming an array file


class ArrayWriter:
    """Append arrays of one dtype to `<path>` through a temp file; `publish` renames it into place."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype, self.count = Path(path), np.dtype(dtype), 0
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed by publish/abort

    def append(self, arr: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self.count += len(arr)

    def publish(self) -> int:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        return self.count

    def abort(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)


class ArrayReader:
    """Read an array file front to back: `read(n)` returns exactly the next n records."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {self.dtype} records (truncated?)")
        self.count = size // self.dtype.itemsize
        self._f = open(self.path, "rb")  # noqa: SIM115 - closed by close() / the context manager

    def read(self, n: int) -> np.ndarray:
        data = self._f.read(n * self.dtype.itemsize)
        if len(data) != n * self.dtype.itemsize:
            raise ValueError(f"{self.path}: wanted {n} more records, file ended after {len(data)} bytes")
        return np.frombuffer(data, dtype=self.dtype)

    def chunks(self, size: int = CHUNK_RECORDS) -> Iterator[np.ndarray]:
        left = self.count
        while left:
            n = min(size, left)
            yield self.read(n)
            left -= n

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
