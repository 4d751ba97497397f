"""The work folder of a sharding run (scan spills, per-document arrays, step markers): a local folder, or an
s3:// prefix so that workers on other machines (Dask) need nothing shared but S3.

Steps always compute in a local folder. With an S3 work prefix that folder is a per-machine cache
(`$NIGHTLOOM_SHARD_CACHE`, default `<tmp>/nightloom-shard-cache`, then bucket/key): a finished file is uploaded
(`publish`) before the step's marker is written, and a step on another machine downloads what it reads
(`fetch`). Work files never change once published under their name (the folder is keyed by the settings
hash), so a cached copy is always the right one. Markers are read from the work folder itself, so resume works
from whatever any machine finished.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nightloom import storage
from nightloom.storage import S3Config, S3Location

TRANSFERS = 8  # S3 uploads or downloads of one call at once: each mostly waits its round trip


def _each(fn, names) -> None:
    """fn(name) for every name, up to TRANSFERS at once (placement fetches one meta file per scan unit: one after
    the other, a corpus of thousands of units waited a round trip each); the first error is raised."""
    names = list(names)
    if len(names) <= 1:
        for name in names:
            fn(name)
        return
    with ThreadPoolExecutor(min(TRANSFERS, len(names)), thread_name_prefix="nightloom-transfer") as pool:
        for _ in pool.map(fn, names):
            pass


def cache_root() -> Path:
    return Path(os.environ.get("NIGHTLOOM_SHARD_CACHE") or Path(tempfile.gettempdir()) / "nightloom-shard-cache")


class WorkDir:
    """One run's work folder: `local` is where steps read and write files; `uri` is where they are kept."""

    def __init__(self, uri: str, s3: S3Config | None = None):
        self.uri, self.s3 = str(uri), s3 or storage.DEFAULT_S3
        self.remote = storage.is_s3(self.uri)
        if self.remote:
            loc = S3Location.parse(self.uri)
            self.local = cache_root() / loc.bucket / loc.key.strip("/")
        else:
            self.local = Path(self.uri)

    def path(self, name: str) -> Path:
        """The local file for `name` (written here, then published)."""
        return self.local / name

    def marker(self, name: str) -> bytes | None:
        """A step's finished-marker, from the work folder itself (None: the step has not finished)."""
        return storage.read_if_exists(storage.join(self.uri, name), self.s3)

    def write_marker(self, name: str, data: bytes) -> None:
        """Write a step's marker: the last write of a step, after its files are published."""
        storage.write_bytes(storage.join(self.uri, name), data, self.s3)

    def publish(self, *names: str) -> None:
        """Upload finished local files to the S3 work prefix (local work folder: nothing to do)."""
        if self.remote:
            _each(lambda name: storage.upload_file(self.path(name), storage.join(self.uri, name), self.s3), names)

    def fetch(self, *names: str) -> None:
        """Make local copies of work files another machine may have written (cached ones are kept)."""
        if self.remote:
            missing = [name for name in names if not self.path(name).is_file()]
            _each(lambda name: storage.get_file(storage.join(self.uri, name), self.path(name), self.s3), missing)

    def ranged(self, name: str) -> storage.RangeReader | None:
        """A ranged reader of work file `name` on S3 when this machine has no copy of it (None: read the local
        file): what a step needs of a large file another machine wrote, without downloading it whole."""
        if self.remote and not self.path(name).is_file():
            return storage.RangeReader(storage.join(self.uri, name), self.s3)
        return None

    def drop_cache(self) -> None:
        """Delete this machine's cached copies (a worker's, once the run is published)."""
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)

    def remove(self) -> None:
        """Delete the work folder (and this machine's cache of it)."""
        if self.remote:
            storage.delete_tree(self.uri, self.s3)
        shutil.rmtree(self.local, ignore_errors=True)
