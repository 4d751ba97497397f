"""Read shards through their manifest (the trainer's only way in), verifying checksums on request."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from nightloom.sharding import storage
from nightloom.sharding.errors import ShardingError
from nightloom.sharding.manifest import ShardManifest, load_manifest


def read_shard(
    output: str | Path,
    index: int,
    manifest: ShardManifest | None = None,
    verify: bool = True,
    s3: storage.S3Config | None = None,
) -> pa.Table:
    """Shard `index` of the dataset at `output` as an Arrow table; sha256 checked against the manifest."""
    output = str(output)
    manifest = manifest or load_manifest(output, s3)
    info = manifest.shards[index]
    data = storage.read_bytes(storage.join(output, info.path), s3)
    if verify and hashlib.sha256(data).hexdigest() != info.sha256:
        raise ShardingError(f"{storage.join(output, info.path)}: sha256 does not match the manifest (corrupt shard)")
    return pq.read_table(io.BytesIO(data))


def iter_texts(
    output: str | Path,
    shards: Iterable[int],
    manifest: ShardManifest | None = None,
    s3: storage.S3Config | None = None,
) -> Iterator[str]:
    """Documents of the given shards in order (shard by shard, row order within a shard)."""
    manifest = manifest or load_manifest(output, s3)
    for i in shards:
        table = read_shard(output, i, manifest, s3=s3)
        yield from table.column(manifest.text_field).to_pylist()
