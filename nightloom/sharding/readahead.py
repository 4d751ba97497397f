"""Small text files read while a job is planned (to fingerprint them), kept for this process's scan.

A first run over a folder of small files reads each file twice: once to fingerprint it (the settings hash needs
every fingerprint before any scan), once to scan it. On these VMs the open/read/close costs more than hashing
the bytes, so the plan keeps what it read, and the scan takes it instead of reading the file again. Bounded
(KEEP_BYTES in all, files of at most MAX_FILE); an entry is handed out once, and only for the fingerprint it was
read with, so the scan sees exactly the bytes the settings hash covers, even of a file rewritten in between.
Scans in other processes (Dask workers) read the files themselves; so does a scan whose file was not kept.
"""

from __future__ import annotations

import threading

KEEP_BYTES = 64 * 1024 * 1024
MAX_FILE = 1024 * 1024

_lock = threading.Lock()
_kept: dict[str, tuple[str, bytes]] = {}  # uri -> (fingerprint, bytes)
_size = 0


def keep(uri: str, fingerprint: str, data: bytes) -> None:
    """Keep `data` (the bytes `fingerprint` was computed from) for the scan, if it fits the budget."""
    global _size
    if len(data) > MAX_FILE:
        return
    with _lock:
        if _size + len(data) <= KEEP_BYTES and uri not in _kept:
            _kept[uri] = (fingerprint, data)
            _size += len(data)


def take(uri: str, fingerprint: str) -> bytes | None:
    """The kept bytes of `uri` if they have `fingerprint` (the entry is dropped either way), else None."""
    global _size
    with _lock:
        entry = _kept.pop(uri, None)
        if entry is None:
            return None
        _size -= len(entry[1])
    return entry[1] if entry[0] == fingerprint else None


def clear() -> None:
    """Drop everything kept (a new plan, or a run that has scanned)."""
    global _size
    with _lock:
        _kept.clear()
        _size = 0


def kept_bytes() -> int:
    """Bytes kept now (0 once a run has scanned)."""
    return _size
