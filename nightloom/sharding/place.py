"""Place step (the reduce): global dedup and balancing over the scans' hashes; decides every document's shard.

Reads only the scans' metadata (hashes, tokens, bytes: 32 B per document), streamed a chunk at a time, so
memory is bounded whatever the corpus: dedup runs per hash partition (duplicates share their hash, so each
partition of at most PARTITION_DOCS documents is deduplicated on its own; partitions spill to work files when
there is more than one), balancing needs only the per-bucket totals, and the one per-document state kept in
memory is two flags (duplicate, held out: `docflags.DocFlags`, 1 bit each per document). Dedup runs in spill order: a spill keeps input order within
each plain shard, and identical documents share their plain shard, so the first copy in spill order is the first
in input order. Writes one `dest-NNNNN.bin` per input (shard index per spilled row, −1 = dropped duplicate), the
bucket → shard `mapping.bin` and `placement.json`, atomically; a re-run reads them back (resume).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nightloom.records import Record
from nightloom.sharding.arrays import DEST_DTYPE, ArrayReader, ArrayWriter
from nightloom.sharding.balance import VIRTUAL_BUCKETS, balance, check_enough_docs
from nightloom.sharding.docflags import DocFlags
from nightloom.sharding.errors import BadInputError, ShardingError
from nightloom.sharding.hashing import first_occurrences
from nightloom.sharding.job import ShardJob
from nightloom.sharding.quality import enabled as quality_enabled
from nightloom.sharding.quality import quality_removals
from nightloom.sharding.quality_records import QualityCounts
from nightloom.sharding.scan_result import ScanResult
from nightloom.sharding.spill import META_DTYPE

PARTITION_DOCS = 1 << 18  # documents deduplicated in memory at once (~16 MB with the sort's temporaries)
MAX_PARTITIONS = 512  # open partition files at most (past 134M documents the partitions grow instead)
PART_DTYPE = np.dtype([("h1", "<u8"), ("h2", "<u8"), ("g", "<i8")])  # g: the document's global input index


MAPPING_NAME = "mapping.bin"  # bucket → shard (DEST_DTYPE), for the writers: which spill partitions to read


def dest_name(index: int) -> str:
    return f"dest-{index:05d}.bin"


class Placement(Record):
    kept: int
    dedup_dropped: int
    imbalance_before: float
    imbalance: float
    rebalanced: bool
    loads: list[int]  # per shard, on the balance metric
    file_duplicates: list[tuple[int, int]] = []  # (source index, documents dropped as duplicates), where > 0
    heldout: int = 0  # documents set aside as the held-out split
    quality: QualityCounts | None = None  # sharding.filters / near_dup: removed per filter (after exact dedup)
    file_removed: list[tuple[int, int]] = []  # (source index, documents the filters or near-dup removed), where > 0


def duplicates_per_file(work: Path, scans: list[ScanResult], dup: DocFlags) -> list[tuple[int, int]]:
    """(source, duplicates) for every input file that lost documents to dedup. A scan's files hold its
    documents in input order, and each spilled record's `pos` is its place in that order."""
    if not dup.any():
        return []
    out: dict[int, int] = {}  # a file scanned in byte ranges has one entry per range: summed
    found: dict[int, tuple[ScanResult, list[np.ndarray]]] = {}  # scan index -> (scan, pos of its duplicates)
    for s, g, c in _meta_chunks(work, scans):
        hit = dup.get(g, len(c))
        if hit.any():
            found.setdefault(s.index, (s, []))[1].append(c["pos"][hit])
    for s, pos in found.values():
        files = [f for f in s.files if f.docs]
        starts = np.cumsum([0] + [f.docs for f in files[:-1]])
        which = np.searchsorted(starts, np.concatenate(pos), side="right") - 1
        for k, c in enumerate(np.bincount(which, minlength=len(files)).tolist()):
            if c:
                out[files[k].source] = out.get(files[k].source, 0) + c
    return list(out.items())


def check_bad_fraction(job: ShardJob, scans: list[ScanResult]) -> None:
    records = sum(s.records for s in scans)
    bad = sum(s.bad for s in scans)
    if bad and records and bad / records > job.sharding.max_bad_fraction:
        first = next(e for s in scans for e in s.bad_examples)
        raise BadInputError(
            f"{bad} of {records} records are bad ({bad / records:.2%} > max_bad_fraction "
            f"{job.sharding.max_bad_fraction:.2%}); first: {first.file}:{first.line}: {first.reason}"
        )


def _meta_chunks(work: Path, scans: list[ScanResult]) -> Iterator[tuple[ScanResult, int, np.ndarray]]:
    """(scan, global index of the chunk's first document, chunk of META_DTYPE records), in input order."""
    g = 0
    for s in scans:
        if not s.meta:
            continue
        with ArrayReader(work / s.meta, META_DTYPE) as r:
            if r.count != s.docs:
                raise ShardingError(f"internal: {s.meta} holds {r.count} records, the scan counted {s.docs}")
            for chunk in r.chunks():
                yield s, g, chunk
                g += len(chunk)


def duplicate_mask(work: Path, scans: list[ScanResult], total: int) -> DocFlags:
    """Set for every document whose (h1, h2) identity appeared earlier in input order.

    Duplicates share h1, so documents are split into partitions by h1's high bits and each partition is
    deduplicated alone (its records stay in input order, and the sort is stable, so the first is the earliest).
    One partition (the usual case up to PARTITION_DOCS documents) never touches the disk."""
    parts = min(MAX_PARTITIONS, max(1, math.ceil(total / PARTITION_DOCS)))
    if parts == 1:
        h1 = np.empty(total, dtype=np.uint64)
        h2 = np.empty(total, dtype=np.uint64)
        for _, g, c in _meta_chunks(work, scans):
            h1[g : g + len(c)], h2[g : g + len(c)] = c["h1"], c["h2"]
        return DocFlags.from_bools(~first_occurrences(h1, h2))
    dup = DocFlags(total)
    folder = work / "dedup-partitions"
    shutil.rmtree(folder, ignore_errors=True)
    writers = [ArrayWriter(folder / f"part-{i:04d}.bin", PART_DTYPE) for i in range(parts)]
    try:
        for _, g, c in _meta_chunks(work, scans):
            rec = np.empty(len(c), dtype=PART_DTYPE)
            rec["h1"], rec["h2"], rec["g"] = c["h1"], c["h2"], np.arange(g, g + len(c), dtype=np.int64)
            which = (c["h1"] >> np.uint64(40)) % np.uint64(parts)
            order = np.argsort(which, kind="stable")  # group by partition, input order kept within each
            bounds = np.searchsorted(which[order], np.arange(parts + 1, dtype=np.uint64))
            for i in range(parts):
                if bounds[i + 1] > bounds[i]:
                    writers[i].append(rec[order[bounds[i] : bounds[i + 1]]])
        for w in writers:
            w.publish()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    for i in range(parts):
        with ArrayReader(folder / f"part-{i:04d}.bin", PART_DTYPE) as r:
            rec = r.read(r.count)
        dup.set(rec["g"][~first_occurrences(rec["h1"], rec["h2"])])
    shutil.rmtree(folder, ignore_errors=True)
    return dup


def heldout_mask(work: Path, scans: list[ScanResult], dup: DocFlags, amount: float) -> DocFlags:
    """Set for the held-out documents among the kept ones, chosen by hash (score = h1 xor h2; h1 is salted).

    A fraction f holds out every document whose score is below f·2^64 (each decided alone, so adding documents
    never moves another one); a count n holds out the n lowest scores (ties: input order), keeping only n
    candidates in memory."""
    held = DocFlags(dup.n)
    if amount < 1:
        limit = np.uint64(min(int(amount * 2**64), 2**64 - 1))
        for _, g, c in _meta_chunks(work, scans):
            held.set(g + np.flatnonzero(((c["h1"] ^ c["h2"]) < limit) & ~dup.get(g, len(c))))
        return held
    n = int(amount)
    best_s, best_g = np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    for _, g, c in _meta_chunks(work, scans):
        live = np.flatnonzero(~dup.get(g, len(c)))
        best_s = np.concatenate([best_s, (c["h1"] ^ c["h2"])[live]])
        best_g = np.concatenate([best_g, live + g])
        if len(best_s) > n:
            order = np.lexsort((best_g, best_s))[:n]
            best_s, best_g = best_s[order], best_g[order]
    held.set(best_g)
    return held


def _quality_pass(job: ShardJob, work: Path, scans: list[ScanResult], dup: DocFlags):
    """(exact duplicates | documents removed by sharding.filters or near_dup, their counts, per-file removals);
    the filters and near-dup see only what exact dedup kept. Without them: (dup, None, [])."""
    if not quality_enabled(job):
        return dup, None, []
    removed, quality = quality_removals(job, work, scans, dup)
    both = DocFlags.from_bools(dup.get(0, dup.n) | removed.get(0, dup.n))
    return both, quality, duplicates_per_file(work, scans, removed)


def place_documents(job: ShardJob, scans: list[ScanResult]) -> Placement:
    """Dedup (first occurrence in input order wins), balance, and record each kept document's shard."""
    wd = job.work
    out = "placement.json"
    done = wd.marker(out)
    if done is not None:
        return Placement.model_validate_json(done)
    work = wd.local
    work.mkdir(parents=True, exist_ok=True)
    wd.fetch(*(f for s in scans for f in (s.meta, s.quality, s.bands) if f))  # scanned on other machines (S3)
    check_bad_fraction(job, scans)
    scans = sorted(scans, key=lambda s: s.index)
    total = sum(s.docs for s in scans if s.meta)
    if not total:
        records = sum(s.records for s in scans)
        empty, bad = sum(s.empty for s in scans), sum(s.bad for s in scans)
        dropped = sum(s.chats_dropped for s in scans)  # chats longer than seq_len + 1 ids (train.task sft)
        why = (
            f", {dropped} conversations dropped as longer than seq_len + 1 = {job.chat.seq_len + 1} ids"
            if dropped
            else ""
        )
        raise BadInputError(
            f"{job.dataset.path}: zero documents in the whole input ({len(job.sources)} files, {records} records: "
            f"{empty} empty, {bad} bad{why})"
        )
    dup = duplicate_mask(work, scans, total) if job.sharding.dedup else DocFlags(total)
    exact_dropped, file_dups = dup.count(), duplicates_per_file(work, scans, dup)
    dup, quality, file_removed = _quality_pass(job, work, scans, dup)  # the held-out split after it
    kept = total - dup.count()
    held = heldout_mask(work, scans, dup, job.sharding.heldout) if job.has_heldout else DocFlags(total)
    n_held = held.count()
    if job.has_heldout and n_held == 0:
        raise BadInputError(f"{job.dataset.path}: sharding.heldout={job.sharding.heldout} selects no document")
    check_enough_docs(kept - n_held, job.num_shards, job.dataset.path)
    metric = job.sharding.balance_by
    nb = np.uint64(job.num_shards * VIRTUAL_BUCKETS)
    bucket_weights = np.zeros(int(nb), dtype=np.int64)
    for _, g, c in _meta_chunks(work, scans):
        keep = ~(dup.get(g, len(c)) | held.get(g, len(c)))
        buckets = (c["h1"][keep] % nb).astype(np.int64)
        w = None if metric == "rows" else c["tokens" if metric == "tokens" else "nbytes"][keep]
        bucket_weights += np.bincount(buckets, weights=w, minlength=int(nb)).astype(np.int64)
    mapping, before, after, rebalanced, loads = balance(
        bucket_weights, job.num_shards, job.sharding.tolerance, metric, docs=kept - n_held
    )
    writer: ArrayWriter | None = None
    current: ScanResult | None = None
    for s, g, c in _meta_chunks(work, scans):
        if s is not current:
            if writer is not None:
                writer.publish()
                wd.publish(dest_name(current.index))
            writer, current = ArrayWriter(work / dest_name(s.index), DEST_DTYPE), s
        dest = mapping[(c["h1"] % nb).astype(np.int64)].astype(DEST_DTYPE)
        dest[dup.get(g, len(c))] = -1
        dest[held.get(g, len(c))] = job.heldout_index
        writer.append(dest)
    if writer is not None:
        writer.publish()
        wd.publish(dest_name(current.index))
    out_map = ArrayWriter(work / MAPPING_NAME, DEST_DTYPE)
    out_map.append(mapping)
    out_map.publish()
    wd.publish(MAPPING_NAME)
    p = Placement(
        kept=kept,
        dedup_dropped=exact_dropped,
        imbalance_before=before,
        imbalance=after,
        rebalanced=rebalanced,
        loads=[int(x) for x in loads],
        file_duplicates=file_dups,
        heldout=n_held,
        quality=quality,
        file_removed=file_removed,
    )
    wd.write_marker(out, p.model_dump_json().encode())
    return p
