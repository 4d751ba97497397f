"""One flag per document, eight to a byte: placement's per-document state (dropped as a duplicate, held out).

Placement keeps such a flag for every document of the corpus while it decides their shards, so its size is the
one part of the reduce step that grows with the corpus: 5 billion documents (10 TB of 2 KB) take 625 MB a flag
set, where bool arrays took 5 GB each.
"""

from __future__ import annotations

import numpy as np

CHUNK_BYTES = 1 << 24  # count() walks the bits this much at a time


class DocFlags:
    """Flags for documents 0 … n−1 (global input index), all clear at first."""

    def __init__(self, n: int):
        self.n = n
        self.bits = np.zeros((n + 7) // 8, dtype=np.uint8)

    @classmethod
    def from_bools(cls, mask: np.ndarray) -> DocFlags:
        flags = cls(len(mask))
        flags.bits[:] = np.packbits(np.asarray(mask, dtype=bool), bitorder="little")
        return flags

    def set(self, index: np.ndarray) -> None:
        """Set the flags of documents `index` (any order, repeats allowed)."""
        index = np.asarray(index, dtype=np.int64)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.n):
            raise IndexError(f"document index out of 0…{self.n - 1}")
        np.bitwise_or.at(self.bits, index >> 3, np.left_shift(1, index & 7).astype(np.uint8))

    def get(self, start: int, count: int) -> np.ndarray:
        """The flags of documents [start, start + count) as a bool array."""
        if start < 0 or start + count > self.n:
            raise IndexError(f"documents {start}…{start + count - 1} out of 0…{self.n - 1}")
        lo = start & 7
        raw = np.unpackbits(self.bits[start >> 3 : (start + count + 7) >> 3], bitorder="little")
        return raw[lo : lo + count].view(bool)

    def count(self) -> int:
        """How many flags are set."""
        return sum(
            int(np.bitwise_count(self.bits[i : i + CHUNK_BYTES]).sum(dtype=np.int64))
            for i in range(0, len(self.bits), CHUNK_BYTES)
        )

    def any(self) -> bool:
        return bool(self.bits.any())
