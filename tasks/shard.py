"""Thin Prefect tasks around nightloom.sharding's steps (plan, scan one input, place, write one shard, publish).

Every step is idempotent and keyed by the job's settings hash, so Prefect retries and re-runs resume where a
run stopped; results are small pydantic records (the data itself moves through files, never task results).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from nightloom import storage
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
from nightloom.sharding.errors import ShardingError
from nightloom.sharding.job import settings_differences
from nightloom.sharding.manifest import MANIFEST_NAME, ShardInfo, load_manifest
from nightloom.sharding.prepare import existing_manifest
from nightloom.spec import DatasetSpec, ShardingSpec, StorageSpec, TokenizerSpec
from nightloom.storage import StorageError, set_secret_resolver
from tasks.progress import heartbeat, human_bytes

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
    log, t0 = get_run_logger(), time.perf_counter()
    tok_path = getattr(tokenizer, "path", None)
    first_use = [
        what
        for what, todo in (
            ("the sample corpus", dataset.sample and not _exists_locally(dataset.path)),
            ("a tokenizer", getattr(tokenizer, "train_vocab", None) and not _exists_locally(tok_path)),
        )
        if todo
    ]
    log.info(
        "listing and fingerprinting %s%s",
        dataset.path,
        f" (first use: builds {' and '.join(first_use)})" if first_use else "",
    )
    with heartbeat(log, "plan-shards"):
        job = plan_job(dataset, sharding, storage, tokenizer=tokenizer, chat=chat)
    log.info(
        "%d input file(s), %s, in %d scan unit(s), %d ignored by name; settings hash %s; %.1f s",
        len(job.sources),
        human_bytes(sum(src.size for src in job.sources)),
        len(job.units),
        len(job.ignored),
        job.settings_hash,
        time.perf_counter() - t0,
    )
    return job


def _exists_locally(path: str | None) -> bool:
    """A local path that exists (an s3:// one counts as there: nothing is built on S3)."""
    return path is None or "://" in path or Path(path).exists()


@task(name="reuse-manifest", cache_policy=NO_CACHE)
def reuse_manifest_task(job: ShardJob) -> ShardManifest | None:
    """The finished manifest for these exact inputs and settings, if any (then nothing else runs)."""
    done = existing_manifest(job.output, job.settings_hash, job.s3)
    if done is None:
        refuse_other_settings(job)
        get_run_logger().info(
            "no finished manifest for settings hash %s at %s: sharding", job.settings_hash, job.output
        )
    else:
        get_run_logger().info(
            "%s/manifest.json has settings hash %s: reusing its %d shards",
            job.output,
            job.settings_hash,
            done.num_shards,
        )
    return done


def refuse_other_settings(job: ShardJob) -> None:
    """A manifest at the output made with other sharding settings is another spec's (or deployment's) dataset:
    refused with the differences, never overwritten (inputs that changed under the same settings re-shard)."""
    uri = storage.join(job.output, MANIFEST_NAME)
    if not storage.exists(uri, job.s3):
        return
    try:
        there = load_manifest(uri, job.s3)
    except (ValueError, OSError):
        return  # unreadable: a half-written folder of ours, re-sharded
    if diffs := settings_differences(job, there):
        raise ShardingError(
            f"sharding.output {job.output} holds shards made with other settings ({'; '.join(diffs)}): "
            "another spec's or deployment's; give this run a sharding.output of its own, or delete that folder "
            "to re-shard there"
        )


@task(name="scan-input", cache_policy=NO_CACHE, task_run_name="scan-input-{index}")
def scan_input_task(job: ShardJob, index: int) -> ScanResult:
    """Scan unit `index`: one input file, or several small ones in order."""
    log, t0 = get_run_logger(), time.perf_counter()
    with heartbeat(log, f"scan-input-{index}"):
        scan = scan_unit(job, index)
    log.info(
        "unit %d: %d file(s), %s read, %s records: %s documents kept, %s empty, %s bad; %.2f s",
        index,
        len(job.units[index]),
        human_bytes(job.unit_bytes(index)),
        f"{scan.records:,}",
        f"{scan.docs:,}",
        f"{scan.empty:,}",
        f"{scan.bad:,}",
        time.perf_counter() - t0,
    )
    return scan


@task(name="place-documents", cache_policy=NO_CACHE)
def place_documents_task(job: ShardJob, scans: list[ScanResult]) -> Placement:
    """Global dedup, the held-out split and token balancing: which shard each document goes to."""
    log, t0 = get_run_logger(), time.perf_counter()
    with heartbeat(log, "place-documents"):
        placement = place_documents(job, scans)
    log.info(
        "placed %s documents in %d shards: %s duplicates dropped, %s held out; imbalance %.4f -> %.4f%s; %.2f s",
        f"{placement.kept:,}",
        job.num_shards,
        f"{placement.dedup_dropped:,}",
        f"{placement.heldout:,}",
        placement.imbalance_before,
        placement.imbalance,
        " (rebalanced)" if placement.rebalanced else "",
        time.perf_counter() - t0,
    )
    return placement


def write_task_name() -> str:
    """`write-shard-N`, or `write-heldout` for the held-out split (its index follows the training shards')."""
    from prefect.runtime import task_run

    job, index = task_run.parameters["job"], task_run.parameters["index"]
    return "write-heldout" if job.has_heldout and index == job.heldout_index else f"write-shard-{index}"


@task(name="write-shard", cache_policy=NO_CACHE, task_run_name=write_task_name)
def write_shard_task(job: ShardJob, scans: list[ScanResult], index: int) -> ShardInfo:
    """Write one Parquet shard (or the held-out split) and its token files."""
    log, t0 = get_run_logger(), time.perf_counter()
    what = "held-out split" if job.has_heldout and index == job.heldout_index else f"shard {index}"
    with heartbeat(log, f"write {what}"):
        info = write_shard(job, scans, index)
    log.info(
        "%s: %s rows, %s tokens, %s -> %s/%s; %.2f s",
        what,
        f"{info.rows:,}",
        f"{info.tokens:,}",
        human_bytes(info.bytes),
        job.output,
        info.path,
        time.perf_counter() - t0,
    )
    return info


@task(name="publish-manifest", cache_policy=NO_CACHE)
def publish_manifest_task(
    job: ShardJob, scans: list[ScanResult], placement: Placement, infos: list[ShardInfo]
) -> ShardManifest:
    """Write manifest.json last: readers see the dataset only once every shard is durable."""
    t0 = time.perf_counter()
    manifest = publish_manifest(job, scans, placement, infos)
    get_run_logger().info(
        "published %s/manifest.json: %d shards (+ held-out split: %s), %s rows, %s tokens, %s; %.2f s",
        job.output,
        manifest.num_shards,
        "yes" if manifest.heldout else "no",
        f"{sum(i.rows for i in infos):,}",
        f"{sum(i.tokens for i in infos):,}",
        human_bytes(sum(i.bytes for i in infos)),
        time.perf_counter() - t0,
    )
    return manifest


def report_shards(manifest: ShardManifest, output: str, reused: bool) -> None:
    """Table artifact: per-shard rows/tokens/bytes, share of the mean, and the verdict row."""
    summary = summarize(manifest, output)
    desc = f"Shards at {output}" + (" (reused: same inputs and settings)" if reused else "")
    create_table_artifact(key=ARTIFACT_KEY, table=summary.table(), description=desc)


def report_failure(message: str) -> None:
    create_markdown_artifact(key=ARTIFACT_KEY, markdown=f"# Sharding failed\n\n```\n{message}\n```\n")
