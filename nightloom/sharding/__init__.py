"""Hash sharding: deterministic, deduplicated, balanced Parquet shards, each with its token ids as a Megatron
indexed dataset (.bin/.idx), plus a manifest, local or on S3.

Pure logic (no Prefect): `shard_dataset` runs everything in-process; flows/shard.py maps the same steps
(`plan_job`, `scan_unit`, `place_documents`, `write_shard`, `publish`) over Prefect tasks.
"""

from nightloom.sharding.assign import DPAssignment, RankShards, assign_shards
from nightloom.sharding.corpus import ensure_sample_corpus
from nightloom.sharding.errors import BadInputError, ShardingError, StorageError, TooSmallError
from nightloom.sharding.job import ShardJob, plan_job
from nightloom.sharding.manifest import ShardManifest, load_manifest
from nightloom.sharding.pipeline import publish, run_job, shard_dataset
from nightloom.sharding.placement import Placement, place_documents
from nightloom.sharding.read import iter_texts, read_shard
from nightloom.sharding.scan import ScanResult, scan_unit
from nightloom.sharding.summary import ShardSummary, summarize
from nightloom.sharding.writer import write_shard

__all__ = [
    "BadInputError",
    "DPAssignment",
    "Placement",
    "RankShards",
    "ScanResult",
    "ShardJob",
    "ShardManifest",
    "ShardSummary",
    "ShardingError",
    "StorageError",
    "TooSmallError",
    "assign_shards",
    "ensure_sample_corpus",
    "iter_texts",
    "load_manifest",
    "place_documents",
    "plan_job",
    "publish",
    "read_shard",
    "run_job",
    "scan_unit",
    "shard_dataset",
    "summarize",
    "write_shard",
]
