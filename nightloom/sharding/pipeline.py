"""shard_dataset: plan → scan each input → place (dedup + balance) → write each shard (Parquet text + .bin/.idx
token files) → publish the manifest (last), in one process (`run_job`: threads for scan and write).

Each step is a pure, idempotent function of a `ShardJob` and the previous steps' small results (prepare.py, scan.py,
place.py, write.py, publish.py), so the flow (flows/shard.py) can map them over Prefect tasks and this module can
run them in a plain loop or a pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from nightloom.chat import ChatSettings
from nightloom.sharding import readahead
from nightloom.sharding.job import ShardJob
from nightloom.sharding.manifest import ShardInfo, ShardManifest
from nightloom.sharding.place import place_documents
from nightloom.sharding.prepare import existing_manifest, plan_job
from nightloom.sharding.publish import publish_manifest
from nightloom.sharding.scan import scan_unit
from nightloom.sharding.scan_arrow import usable_cpus
from nightloom.sharding.scan_result import ScanResult
from nightloom.sharding.write import write_shard
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
    return publish_manifest(job, scans, placement, infos)


def shard_dataset(
    dataset: DatasetSpec,
    sharding: ShardingSpec,
    storage: StorageSpec | None = None,
    *,
    workers: int | None = None,
    workdir: str | None = None,
    progress: Progress | None = None,
    tokenizer: TokenizerSpec | str | None = None,
    chat: ChatSettings | None = None,
) -> ShardManifest:
    """Hash-shard `dataset` into `sharding.num_shards` Parquet shards + manifest.json at `sharding.output`.

    Deterministic (same bytes for any `workers`), idempotent (same settings_hash ⇒ no work, same manifest),
    resumable (finished scans/shards of an interrupted run are reused). Raises ShardingError subclasses, or
    StorageError when the object store cannot be used. `chat` (train.task sft): the records are chats.
    """
    job = plan_job(dataset, sharding, storage, workdir=workdir, tokenizer=tokenizer, chat=chat)
    return run_job(job, workers=workers, progress=progress)
