"""Hash sharding: deterministic, deduplicated, balanced Parquet shards, each with its token ids as a Megatron
indexed dataset (.bin/.idx), plus a manifest, local or on S3.

Pure logic (no Prefect). One module per step: prepare.py (`plan_job`), scan.py (`scan_unit`), place.py
(`place_documents`), write.py (`write_shard`), publish.py (`publish_manifest`); pipeline.py's `shard_dataset` runs them
in-process, flows/shard.py maps the same steps over Prefect tasks.
"""

from importlib import import_module

# name -> the submodule that defines it; imported on first use (PEP 562), so `import nightloom.sharding.manifest`
# (every training rank reads a manifest) does not import pyarrow, xxhash and the whole sharder (~0.6 s per rank)
_EXPORTS = {
    "ensure_sample_corpus": "corpus",
    "BadInputError": "errors",
    "ShardingError": "errors",
    "TooSmallError": "errors",
    "ShardJob": "job",
    "ShardManifest": "manifest",
    "load_manifest": "manifest",
    "run_job": "pipeline",
    "shard_dataset": "pipeline",
    "Placement": "place",
    "place_documents": "place",
    "plan_job": "prepare",
    "publish_manifest": "publish",
    "scan_unit": "scan",
    "ScanResult": "scan_result",
    "ShardSummary": "summary",
    "summarize": "summary",
    "write_shard": "write",
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
