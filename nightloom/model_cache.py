"""One verified local copy of an s3:// model prefix per machine, shared by the native trainer and XTuner.

The folder is `<cache root>/<content key>`: the key hashes every object's name, size and ETag, so a changed
model gets a new folder and one model is cached once whichever backend asked for it. The download holds a
file lock (ranks, runs and nodes sharing the cache fetch once), each file is checked against its object
(size; MD5 where the ETag is one, i.e. a single-part upload), the caller's folder check runs, and the stamp is
written last: a folder without its stamp is a crashed download and is fetched again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nightloom import storage
from nightloom.node_reply import Readied
from nightloom.util import atomic_write_text

STAMP = ".nightloom-model.json"


class ModelFetchError(ValueError):
    """A fetched file differs from its object (names the object and what differs)."""


@dataclass(frozen=True)
class FetchedModel(Readied):
    """A model ready on one machine, in its local folder (`created`: this call downloaded it)."""

    path: str


def default_cache_root() -> Path:
    """`$NIGHTLOOM_MODEL_CACHE`, else ~/.cache/nightloom/models (per user and machine, survives runs)."""
    return Path(os.environ.get("NIGHTLOOM_MODEL_CACHE") or Path.home() / ".cache" / "nightloom" / "models")


def content_key(objects: Sequence[storage.S3Object]) -> str:
    """The cache folder's name: a hash over every object's name, size and ETag (a changed file, a new key)."""
    h = hashlib.sha256()
    for o in objects:
        h.update(f"{o.name}\t{o.size}\t{o.etag}\n".encode())
    return h.hexdigest()[:20]


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(dest: Path, objects: Sequence[storage.S3Object], uri: str) -> None:
    """Every file as its object: the size always; the MD5 where the ETag is one (a multipart ETag,
    `md5-of-parts-N`, depends on the uploader's part size)."""
    for o in objects:
        p = dest / o.name
        got = p.stat().st_size if p.is_file() else None
        if got != o.size:
            raise ModelFetchError(f"{uri}/{o.name}: fetched {got} bytes, the object has {o.size}")
        if o.etag and "-" not in o.etag and _md5(p) != o.etag:
            raise ModelFetchError(f"{uri}/{o.name}: fetched file's MD5 differs from the object's ETag {o.etag}")


def fetch_model(
    uri: str,
    cache_root: Path | None = None,
    s3: storage.S3Config | None = None,
    *,
    check_names: Callable[[list[str]], None] | None = None,
    check_folder: Callable[[Path], object] | None = None,
    log: Callable[[str], None] = print,
) -> FetchedModel:
    """The s3:// prefix `uri` as a local folder: reused when its stamp is there, else downloaded under a lock,
    checked file by file, passed through `check_folder`, stamped last. `check_names` sees the object names
    before anything is downloaded (a model without weights fails in one listing)."""
    t0 = time.monotonic()
    root = Path(cache_root or default_cache_root())
    objects = storage.list_objects(uri, s3)
    if check_names is not None:
        check_names([o.name for o in objects])
    key = content_key(objects)
    dest = root / key
    if (dest / STAMP).is_file():
        return FetchedModel(key, False, time.monotonic() - t0, str(dest))
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / STAMP).is_file():  # another process (or node sharing the cache) fetched it meanwhile
            return FetchedModel(key, False, time.monotonic() - t0, str(dest))
        shutil.rmtree(dest, ignore_errors=True)  # a crashed download's leftovers
        for o in objects:
            storage.get_file(storage.join(uri, o.name), dest / o.name, s3)
        verify(dest, objects, uri)
        if check_folder is not None:
            check_folder(dest)
        stamp = {"uri": uri, "key": key, "files": len(objects), "bytes": sum(o.size for o in objects)}
        atomic_write_text(dest / STAMP, json.dumps(stamp) + "\n")
    secs = time.monotonic() - t0
    log(f"model {uri}: fetched {len(objects)} files into {dest} in {secs:.2f} s")
    return FetchedModel(key, True, secs, str(dest))
