"""Thin Prefect tasks around nightloom.sharding's steps (plan, scan one input, place, write one shard, publish).

Every step is idempotent and keyed by the job's settings hash, so Prefect retries and re-runs resume where a
run stopped; results are small pydantic records (the data itself moves through files, never task results).
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from nightloom.chat import ChatSettings
from nightloom.sharding import (
    Placement,
    ScanResult,
    ShardJob,
    ShardManifest,
    place_documents,
    plan_job,
    publish_manifest,
    scan_unit,
    summarize,
    write_shard,
)
from nightloom.sharding.manifest import ShardInfo
from nightloom.sharding.plan import existing_manifest
from nightloom.spec import DatasetSpec, ShardingSpec, StorageSpec, TokenizerSpec
from nightloom.storage import StorageError, set_secret_resolver

ARTIFACT_KEY = "shard-report"


def prefect_secret_keys(name: str) -> tuple[str, str]:
    """`storage.credentials_secret`: a Prefect Secret block holding 'KEY_ID:SECRET' (read where files are opened)."""
    from prefect.blocks.system import Secret

    key_id, sep, key = str(Secret.load(name).get()).partition(":")
    if not sep or not key_id or not key:
        raise StorageError(f"Prefect Secret {name!r}: expected 'KEY_ID:SECRET'")
    return key_id, key


set_secret_resolver(prefect_secret_keys)  # every process that runs these tasks (Dask workers too) imports this


@task(name="plan-shards", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def plan_shards_task(
    dataset: DatasetSpec,
    sharding: ShardingSpec,
    storage: StorageSpec | None,
    tokenizer: TokenizerSpec | None = None,
    chat: ChatSettings | None = None,
) -> ShardJob:
    """List and fingerprint inputs (builds the sample corpus, and a `train_vocab` tokenizer, on first use);
    `chat`: train.task sft's chat settings (records are chats)."""
    job = plan_job(dataset, sharding, storage, tokenizer=tokenizer, chat=chat)
    get_run_logger().info(
        "%d input file(s) in %d scan unit(s), %d ignored by name; settings hash %s",
        len(job.sources),
        len(job.units),
        len(job.ignored),
        job.settings_hash,
    )
    return job


@task(name="reuse-manifest", cache_policy=NO_CACHE)
def reuse_manifest_task(job: ShardJob) -> ShardManifest | None:
    """The finished manifest for these exact inputs and settings, if any (then nothing else runs)."""
    return existing_manifest(job.output, job.settings_hash, job.s3)


@task(name="scan-input", cache_policy=NO_CACHE, task_run_name="scan-input-{index}")
def scan_input_task(job: ShardJob, index: int) -> ScanResult:
    """Scan unit `index`: one input file, or several small ones in order."""
    return scan_unit(job, index)


@task(name="place-documents", cache_policy=NO_CACHE)
def place_documents_task(job: ShardJob, scans: list[ScanResult]) -> Placement:
    return place_documents(job, scans)


@task(name="write-shard", cache_policy=NO_CACHE, task_run_name="write-shard-{index}")
def write_shard_task(job: ShardJob, scans: list[ScanResult], index: int) -> ShardInfo:
    return write_shard(job, scans, index)


@task(name="publish-manifest", cache_policy=NO_CACHE)
def publish_manifest_task(
    job: ShardJob, scans: list[ScanResult], placement: Placement, infos: list[ShardInfo]
) -> ShardManifest:
    return publish_manifest(job, scans, placement, infos)


def report_shards(manifest: ShardManifest, output: str, reused: bool) -> None:
    """Table artifact: per-shard rows/tokens/bytes, share of the mean, and the verdict row."""
    summary = summarize(manifest, output)
    desc = f"Shards at {output}" + (" (reused: same inputs and settings)" if reused else "")
    create_table_artifact(key=ARTIFACT_KEY, table=summary.table(), description=desc)


def report_failure(message: str) -> None:
    create_markdown_artifact(key=ARTIFACT_KEY, markdown=f"# Sharding failed\n\n```\n{message}\n```\n")
