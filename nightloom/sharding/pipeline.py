"""shard_dataset: plan → scan each input → place (dedup + balance) → write each shard (Parquet text + .bin/.idx
token files) → manifest (last).

Each step is a pure, idempotent function of a `ShardJob` and the previous steps' small results, so the flow
(flows/shard.py) can map them over Prefect tasks and this module can run them in a plain loop or a pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from nightloom.sharding import readahead, storage
from nightloom.sharding.accounting import account_files
from nightloom.sharding.job import WORK_DIR_NAME, ShardJob, existing_manifest, plan_job
from nightloom.sharding.manifest import MANIFEST_NAME, ShardInfo, ShardManifest
from nightloom.sharding.placement import Placement, place_documents
from nightloom.sharding.scan import MAX_BAD_EXAMPLES, ScanResult, scan_unit, usable_cpus
from nightloom.sharding.writer import write_shard
from nightloom.spec import DatasetSpec, ShardingSpec, StorageSpec, TokenizerSpec

Progress = Callable[[str, int, int], None]  # (stage, items finished so far, total items)


class _Counter:
    """Finished items per stage, counted across worker threads, reported to a Progress callback."""

    def __init__(self, progress: Progress | None):
        self.progress, self.done, self.lock = progress, {}, threading.Lock()

    def add(self, stage: str, finished: int, total: int) -> None:
        with self.lock:
            self.done[stage] = done = self.done.get(stage, 0) + finished
            if self.progress is not None:
                self.progress(stage, done, total)


def build_manifest(
    job: ShardJob, scans: list[ScanResult], placement: Placement, infos: list[ShardInfo]
) -> ShardManifest:
    scans = sorted(scans, key=lambda s: s.index)
    infos = sorted(infos, key=lambda i: i.index)
    heldout = next((i for i in infos if i.index == job.heldout_index), None)
    infos = [i for i in infos if i.index != job.heldout_index]
    examples = [e for s in scans for e in s.bad_examples][:MAX_BAD_EXAMPLES]
    sources, files = account_files(job, scans, placement)
    return ShardManifest(
        num_shards=job.num_shards,
        key=job.key_name,
        salt=job.sharding.salt,
        text_field=job.dataset.text_field,
        keep_columns=list(job.dataset.keep_columns),
        tokenizer=job.tokenizer_id,
        compression=job.sharding.compression,
        balance_by=job.sharding.balance_by,
        tolerance=job.sharding.tolerance,
        imbalance=round(placement.imbalance, 6),
        imbalance_before_rebalance=round(placement.imbalance_before, 6),
        rebalanced=placement.rebalanced,
        balanced=placement.imbalance <= job.sharding.tolerance,
        rows=sum(i.rows for i in infos),
        tokens=sum(i.tokens for i in infos),
        bytes=sum(i.bytes for i in infos),
        dedup_dropped=placement.dedup_dropped,
        empty_skipped=sum(s.empty for s in scans),
        bad_records=sum(s.bad for s in scans),
        bad_examples=examples,
        files_read=files.read,
        files_empty=files.empty,
        files_bad=files.bad,
        files_duplicate=files.duplicate,
        files_ignored=files.ignored,
        file_examples=files.examples,
        sources=sources,
        shards=infos,
        heldout=heldout,
        settings_hash=job.settings_hash,
    )


def publish(job: ShardJob, scans: list[ScanResult], placement: Placement, infos: list[ShardInfo]) -> ShardManifest:
    """Write manifest.json (the last write: its presence means a complete dataset), then clean up."""
    manifest = build_manifest(job, scans, placement, infos)
    storage.write_bytes(storage.join(job.output, MANIFEST_NAME), manifest.to_json().encode(), job.s3)
    shards = manifest.shards + ([manifest.heldout] if manifest.heldout else [])
    keep = {f for s in shards for f in s.files()}
    for rel, _ in storage.list_files(job.output, job.s3):
        old = rel.startswith(("shard-", "heldout.")) and rel.endswith((".parquet", ".bin", ".idx"))
        if "/" not in rel and old and rel not in keep:
            storage.delete(storage.join(job.output, rel), job.s3)  # shards of an earlier, different run
    job.work.remove()
    # also work left in the output by interrupted runs with other settings
    storage.delete_tree(storage.join(job.output, WORK_DIR_NAME), job.s3)
    return manifest


def shard_indices(job: ShardJob) -> list[int]:
    """Every file to write: the training shards, then the held-out split if there is one."""
    return list(range(job.num_shards)) + ([job.heldout_index] if job.has_heldout else [])


def default_workers() -> int:
    """Threads for scan and write: one per usable CPU (Arrow parses and compresses with the GIL released), at
    most 8."""
    return usable_cpus()


def _map(fn, items: Iterable, workers: int) -> list:
    items = list(items)
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def run_job(job: ShardJob, workers: int | None = None, progress: Progress | None = None) -> ShardManifest:
    """Execute a planned job (resuming whatever an interrupted run finished)."""
    try:
        return _run(job, workers or default_workers(), progress)
    finally:
        readahead.clear()  # what the plan kept for the scan and the scan did not take


def _run(job: ShardJob, workers: int, progress: Progress | None) -> ShardManifest:
    done = existing_manifest(job.output, job.settings_hash, job.s3)
    if done is not None:
        return done
    note = _Counter(progress).add
    n_src = len(job.sources)

    def scan(i: int) -> ScanResult:
        r = scan_unit(job, i)
        note("scan", job.files_finished(i), n_src)
        return r

    scans = _map(scan, range(len(job.units)), workers)
    placement = place_documents(job, scans)

    indices = shard_indices(job)

    def write(i: int) -> ShardInfo:
        info = write_shard(job, scans, i)
        note("write", 1, len(indices))
        return info

    infos = _map(write, indices, workers)
    return publish(job, scans, placement, infos)


def shard_dataset(
    dataset: DatasetSpec,
    sharding: ShardingSpec,
    storage: StorageSpec | None = None,
    *,
    workers: int | None = None,
    workdir: str | None = None,
    progress: Progress | None = None,
    tokenizer: TokenizerSpec | str | None = None,
) -> ShardManifest:
    """Hash-shard `dataset` into `sharding.num_shards` Parquet shards + manifest.json at `sharding.output`.

    Deterministic (same bytes for any `workers`), idempotent (same settings_hash ⇒ no work, same manifest),
    resumable (finished scans/shards of an interrupted run are reused). Raises ShardingError subclasses.
    """
    job = plan_job(dataset, sharding, storage, workdir=workdir, tokenizer=tokenizer)
    return run_job(job, workers=workers, progress=progress)
