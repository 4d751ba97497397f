"""The shard stage's quality pass: per scan unit (on whichever machine scanned it) each spilled document's filter
verdict and MinHash band keys (quality_scan.py); in the place step (here), near-duplicate clusters over the whole
corpus.

Scan side (`quality_scan.scan_quality`): reads the unit's spill back in its row order (the meta's), runs the enabled filters
(filters.py) and signs the documents they keep (near_dup.py), and writes `quality-NNNNN.bin` (QUALITY_DTYPE per
document) and `bands-NNNNN.bin` (the band keys), which travel like the other work files (an S3 work folder on
Dask). Place side (`quality_removals`): after exact dedup, the filtered documents, then one document kept per
near-duplicate cluster (the smallest content hash, xxh3-64 of the text, so the same on every rerun, whatever the units or
machines); counts documents and tokens removed per filter. Memory on the place side: the band keys of the whole
corpus (8 B per band per document: 112 B with FineWeb's 14 bands), not spilled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nightloom.sharding import near_dup
from nightloom.sharding.arrays import ArrayReader
from nightloom.sharding.docflags import DocFlags
from nightloom.sharding.job import ShardJob
from nightloom.sharding.quality_records import QualityCounts, Removed
from nightloom.sharding.scan_result import ScanResult
from nightloom.sharding.spill import META_DTYPE
from nightloom.spec.quality import FILTER_NAMES

#: code: 0 kept, 1 + index in FILTER_NAMES: removed by it; has: a MinHash signature; key: xxh3-64 of the text (the
#: member of a near-duplicate cluster kept has the smallest, as near_dup.near_duplicates keeps)
QUALITY_DTYPE = np.dtype([("code", "u1"), ("has", "u1"), ("key", "<u8")])


def enabled(job: ShardJob) -> bool:
    return job.chat is None and (job.sharding.filters is not None or job.sharding.near_dup is not None)


def bands_dtype(bands: int) -> np.dtype:
    """A `bands-NNNNN.bin` record: one document's band keys."""
    return np.dtype([("k", "<u8", (bands,))])


def params(job: ShardJob) -> near_dup.MinHashParams:
    nd = job.sharding.near_dup
    return near_dup.MinHashParams(ngram=nd.ngram, bands=nd.bands, rows=nd.rows, seed=nd.seed)


def quality_removals(job: ShardJob, work: Path, scans: list[ScanResult], dup: DocFlags):
    """(removed: DocFlags of documents the filters or near-dup remove, after exact dedup; their counts; per input
    file, documents removed) for the place step."""
    total, nd = dup.n, job.sharding.near_dup
    code = np.zeros(total, dtype=np.uint8)
    has = np.zeros(total, dtype=bool)
    tokens = np.zeros(total, dtype=np.int64)
    content = np.zeros(total, dtype=np.uint64)
    keys = np.zeros((total, nd.bands), dtype=np.uint64) if nd is not None else None
    g = 0
    for s in scans:
        if not s.meta:
            continue
        with ArrayReader(work / s.meta, META_DTYPE) as r:
            m = r.read(r.count)
        with ArrayReader(work / s.quality, QUALITY_DTYPE) as r:
            q = r.read(r.count)
        n = len(m)
        code[g : g + n], has[g : g + n], tokens[g : g + n], content[g : g + n] = (
            q["code"],
            q["has"],
            m["tokens"],
            q["key"],
        )
        if keys is not None:
            with ArrayReader(work / s.bands, bands_dtype(nd.bands)) as r:
                keys[g : g + n] = r.read(r.count)["k"]
        g += n
    exact = dup.get(0, total)
    code[exact] = 0  # exact duplicates are counted as such, not again here
    counts = QualityCounts()
    for k, name in enumerate(FILTER_NAMES):
        hit = code == k + 1
        if job.sharding.filters is not None and name in job.sharding.filters.enabled():
            counts.removed[name] = Removed(documents=int(hit.sum()), tokens=int(tokens[hit].sum()))
    removed = code != 0
    if keys is not None:
        live = has & ~exact & ~removed
        near = live & ~near_dup.keep_one(near_dup.cluster(keys, live), content)
        counts.removed["near_dup"] = Removed(documents=int(near.sum()), tokens=int(tokens[near].sum()))
        removed |= near
    return DocFlags.from_bools(removed), counts
