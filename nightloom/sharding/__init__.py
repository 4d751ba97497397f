"""Hash sharding: deterministic, deduplicated, balanced Parquet shards, each with its token ids as a Megatron
indexed dataset (.bin/.idx), plus a manifest, local or on S3.

Pure logic (no Prefect): `shard_dataset` runs everything in-process; flows/shard.py maps the same steps
(`plan_job`, `scan_unit`, `place_documents`, `write_shard`, `publish`) over Prefect tasks.
"""

from importlib import import_module

# name -> the submodule that defines it; imported on first use (PEP 562), so `import nightloom.sharding.manifest`
# (every training rank reads a manifest) does not import pyarrow, xxhash and the whole sharder (~0.6 s per rank)
_EXPORTS = {
    "DPAssignment": "assign",
    "RankShards": "assign",
    "assign_shards": "assign",
    "ensure_sample_corpus": "corpus",
    "BadInputError": "errors",
    "ShardingError": "errors",
    "StorageError": "errors",
    "TooSmallError": "errors",
    "ShardJob": "job",
    "plan_job": "job",
    "ShardManifest": "manifest",
    "load_manifest": "manifest",
    "publish": "pipeline",
    "run_job": "pipeline",
    "shard_dataset": "pipeline",
    "Placement": "placement",
    "place_documents": "placement",
    "iter_texts": "read",
    "read_shard": "read",
    "ScanResult": "scan",
    "scan_unit": "scan",
    "ShardSummary": "summary",
    "summarize": "summary",
    "write_shard": "writer",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
