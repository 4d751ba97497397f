"""Content fingerprints of input files: xxh3-128 of a local file's bytes, kept from run to run (FingerprintCache),
or an S3 object's ETag. They enter the settings hash, so changed data gives a new dataset and unchanged data none.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import orjson
import xxhash

from nightloom import storage
from nightloom.sharding import readahead
from nightloom.sharding.sources import SourceRef
from nightloom.storage import S3Config
from nightloom.util import cache_root


def xxh3_file(path: Path | str, chunk: int = 1 << 22, size: int | None = None) -> str:
    """xxh3-128 of a file's bytes, read with plain os calls in reads of at most `chunk` (a small file: one read of
    its size; `read(chunk)` would allocate the whole chunk for it, which cost more than the hash on a folder of
    small files). `size`: what a listing just said (saves the fstat; the whole file is hashed whatever its size)."""
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        want = min(chunk, (os.fstat(fd).st_size if size is None else size) + 1)
        while b := os.read(fd, want):
            h.update(b)
            want = chunk
    finally:
        os.close(fd)
    return h.hexdigest()


def hash_file(src: SourceRef, read_ahead: bool = False) -> str:
    """A local file's fingerprint: xxh3-128 of its bytes. With `read_ahead`, a small text file is read whole and
    its bytes kept for this process's scan (readahead.py), so a first run reads it once."""
    if read_ahead and src.format == "text" and src.size <= readahead.MAX_FILE:
        data = storage.read_whole(src.uri, src.size)
        fp = "xxh3-128:" + xxhash.xxh3_128(data).hexdigest()
        readahead.keep(src.uri, fp, data)
        return fp
    return "xxh3-128:" + xxh3_file(src.uri, size=src.size)


RACY_S = 2.0  # a file changed this recently may change again within its timestamp's resolution: never cached


class FingerprintCache:
    """Content fingerprints (xxh3-128) of one local dataset path's files, kept from run to run in one JSON file
    under `$NIGHTLOOM_CACHE/fingerprints/` and trusted while a file's (size, mtime_ns, ctime_ns, inode) are
    unchanged, so re-sharding an unchanged folder reads no file to fingerprint it (21k small files: one read
    each, ~0.5 s; a 1 TB folder: 1 TB). ctime cannot be set by a user, so rewriting a file with its old mtime
    is still seen. As in git's index, a file changed within RACY_S of the cache write is not cached."""

    VERSION = 1

    def __init__(self, root: str, read_ahead: bool = False):
        base = cache_root() / "fingerprints"
        resolved = str(Path(root).resolve())
        self.path = base / (hashlib.sha256(resolved.encode()).hexdigest()[:32] + ".json")
        self.root, self.entries, self.changed = resolved, {}, False
        self.listed: dict[str, list[int]] = {}  # stat keys of files the listing saw but the cache did not know
        self.read_ahead = read_ahead  # keep small text files' bytes for this process's scan (readahead.py)
        try:
            doc = orjson.loads(self.path.read_bytes())
            if doc.get("version") == self.VERSION and doc.get("root") == resolved and isinstance(doc["files"], dict):
                self.entries = doc["files"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no cache, or one this version cannot read: hash again

    @staticmethod
    def _key(st: os.stat_result) -> list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    def _kept(self, rel: str, key: list[int]) -> str:
        """`rel`'s kept fingerprint if it was kept with this stat key, else ""."""
        hit = self.entries.get(rel)
        return hit[4] if isinstance(hit, list) and len(hit) == 5 and hit[:4] == key else ""

    def cached(self, rel: str, st: os.stat_result) -> str:
        """`rel`'s kept fingerprint if `st` (the listing's stat) matches the one it was kept with, else "" (and
        `st` is remembered, so `fingerprint` does not stat the file again)."""
        key = self._key(st)
        fp = self._kept(rel, key)
        if not fp:
            self.listed[rel] = key
        return fp

    def fingerprint(self, src: SourceRef) -> str:
        """The file's fingerprint: the kept one while its stat is unchanged, else its bytes hashed (and kept). The
        stat is the listing's if it made one (taken before the read, so a file changed in between is a miss next
        time, never a wrong hit)."""
        listed = self.listed.pop(src.rel, None)  # the listing's stat, which `cached` already found no hit for
        key = listed or self._key(os.stat(src.uri))
        if listed is None and (fp := self._kept(src.rel, key)):
            return fp
        fp = hash_file(src, self.read_ahead)
        self.entries[src.rel] = [*key, fp]
        self.changed = True
        return fp

    def save(self, keep: set[str]) -> None:
        """Write the cache (only `keep`'s entries: the files listed this time), write then rename; a read-only
        home is fine (the next run hashes again)."""
        if not self.changed and keep == set(self.entries):
            return
        newest = (time.time() - RACY_S) * 1e9
        files = {r: e for r, e in self.entries.items() if r in keep and max(e[1], e[2]) < newest}
        if not files and not self.path.exists():
            return  # nothing to keep (all new files): no cache file for every freshly written folder
        try:
            storage.write_bytes(
                str(self.path), orjson.dumps({"version": self.VERSION, "root": self.root, "files": files})
            )
        except OSError:
            pass


def fingerprint_all(
    dataset_path: str, sources: list[SourceRef], s3: S3Config | None = None, cache: FingerprintCache | None = None
) -> list[SourceRef]:
    """Every source with its fingerprint: an S3 object's ETag; a local file's content hash (FingerprintCache;
    `cache`: the one the listing already looked fingerprints up in). Sources that have one are kept as they are."""
    if storage.is_s3(dataset_path):  # a folder's listing already carried them; a single object is asked for
        return [
            src if src.fingerprint else src.model_copy(update={"fingerprint": "etag:" + storage.head(src.uri, s3)[1]})
            for src in sources
        ]
    cache = cache or FingerprintCache(dataset_path)
    # built anew, not model_copy(update=...): 3× cheaper, which shows on 20k files
    out = [
        s
        if s.fingerprint
        else SourceRef(rel=s.rel, uri=s.uri, size=s.size, format=s.format, fingerprint=cache.fingerprint(s))
        for s in sources
    ]
    cache.save({s.rel for s in sources})
    return out
