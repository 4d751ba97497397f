"""Fixed-dtype work arrays (per-document hashes and sizes, per-document shard) as raw little-endian files.

Not .npy: numpy reads an .npy header with ast.literal_eval, and on CPython 3.11.7 concurrent parses in threads
fail with "AST constructor recursion depth mismatch" (gh-106905); shard writers run in threads. The dtype is
fixed by the caller, so the file needs no header. Written atomically (nightloom.util), read with np.fromfile.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nightloom.util import atomic_write_bytes

DEST_DTYPE = np.dtype("<i4")  # shard index per spilled document, -1 = dropped duplicate


def save_array(path: Path, arr: np.ndarray) -> None:
    atomic_write_bytes(path, np.ascontiguousarray(arr).tobytes())


def load_array(path: Path, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(f"{path}: {size} bytes is not a whole number of {dtype} records (truncated work file?)")
    return np.fromfile(path, dtype=dtype)
