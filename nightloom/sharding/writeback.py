"""Finished output files and the page cache: flush each to disk and drop what of it is cached.

The token files and Parquet shards are written past the page cache (nightloom/sharding/directio.py); the small
.idx and anything a fallback wrote through the cache are flushed and dropped here, so the next shards reuse those
pages instead of growing the cache by the output's size (2-3× the corpus with token files).
"""

from __future__ import annotations

import os
from pathlib import Path


def durable_and_uncached(path: Path) -> None:
    """Flush a finished output file to disk and drop it from the page cache (the sharder never reads it again)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
