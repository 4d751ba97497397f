"""Reduce step: global dedup and balancing over the scans' hashes; decides every document's shard.

Reads only the scans' metadata (hashes, tokens, bytes: 32 B per document), so memory grows with
the number of documents, not with their text. Writes one `dest-NNNNN.bin` per input (shard index per spilled
row, −1 = dropped duplicate) and `placement.json`, both atomically; a re-run reads them back (resume).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from nightloom.sharding import storage
from nightloom.sharding.arrays import DEST_DTYPE, load_array, save_array
from nightloom.sharding.balance import VIRTUAL_BUCKETS, balance, check_enough_docs
from nightloom.sharding.errors import BadInputError, ShardingError
from nightloom.sharding.hashing import first_occurrences
from nightloom.sharding.job import ShardJob
from nightloom.sharding.scan import META_DTYPE, ScanResult


def dest_name(index: int) -> str:
    return f"dest-{index:05d}.bin"


class Placement(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kept: int
    dedup_dropped: int
    imbalance_before: float
    imbalance: float
    rebalanced: bool
    loads: list[int]  # per shard, on the balance metric


def check_bad_fraction(job: ShardJob, scans: list[ScanResult]) -> None:
    records = sum(s.records for s in scans)
    bad = sum(s.bad for s in scans)
    if bad and records and bad / records > job.sharding.max_bad_fraction:
        first = next(e for s in scans for e in s.bad_examples)
        raise BadInputError(
            f"{bad} of {records} records are bad ({bad / records:.2%} > max_bad_fraction "
            f"{job.sharding.max_bad_fraction:.2%}); first: {first.file}:{first.line}: {first.reason}"
        )


def place_documents(job: ShardJob, scans: list[ScanResult]) -> Placement:
    """Dedup (first occurrence in input order wins), balance, and record each kept document's shard."""
    job.configure()
    work = Path(job.workdir)
    out = work / "placement.json"
    if out.is_file():
        return Placement.model_validate_json(out.read_bytes())
    check_bad_fraction(job, scans)
    scans = sorted(scans, key=lambda s: s.index)
    metas = [load_array(work / s.meta, META_DTYPE) if s.meta else None for s in scans]
    parts = [m for m in metas if m is not None]
    total = sum(s.records for s in scans)
    if not parts:
        empty, bad = sum(s.empty for s in scans), sum(s.bad for s in scans)
        raise BadInputError(
            f"{job.dataset.path}: zero documents in the whole input ({len(scans)} files, {total} records: "
            f"{empty} empty, {bad} bad)"
        )
    h1 = np.concatenate([m["h1"] for m in parts])
    h2 = np.concatenate([m["h2"] for m in parts])
    keep = first_occurrences(h1, h2) if job.sharding.dedup else np.ones(len(h1), dtype=bool)
    kept = int(keep.sum())
    check_enough_docs(kept, job.num_shards, job.dataset.path)
    metric = job.sharding.balance_by
    if metric == "rows":
        weights = np.ones(len(h1), dtype=np.int64)
    else:
        weights = np.concatenate([m["tokens" if metric == "tokens" else "nbytes"] for m in parts])
    nb = job.num_shards * VIRTUAL_BUCKETS
    buckets = (h1 % np.uint64(nb)).astype(np.int64)
    mapping, before, after, rebalanced, loads = balance(
        buckets[keep], weights[keep], job.num_shards, job.sharding.tolerance, metric
    )
    dest = np.where(keep, mapping[buckets], -1).astype(DEST_DTYPE)
    offset = 0
    for s, m in zip(scans, metas):
        if m is None:
            continue
        n = len(m)
        save_array(work / dest_name(s.index), dest[offset : offset + n])
        offset += n
    if offset != len(dest):
        raise ShardingError("internal: spill sizes changed during placement")
    p = Placement(
        kept=kept,
        dedup_dropped=len(h1) - kept,
        imbalance_before=before,
        imbalance=after,
        rebalanced=rebalanced,
        loads=[int(x) for x in loads],
    )
    storage.write_bytes(out, p.model_dump_json().encode())
    return p
