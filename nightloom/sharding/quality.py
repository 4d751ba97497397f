"""The shard stage's quality pass: per scan unit (on whichever machine scanned it) each spilled document's filter
verdict and MinHash band keys (quality_scan.py); in the place step (here), near-duplicate clusters over the whole
corpus.

Scan side (`quality_scan.scan_quality`): reads the unit's spill back in its row order (the meta's), runs the enabled filters
(filters.py) and signs the documents they keep (near_dup.py), and writes `quality-NNNNN.bin` (QUALITY_DTYPE per
document) and `bands-NNNNN.bin` (the band keys), which travel like the other work files (an S3 work folder on
Dask). Place side (`quality_removals`): after exact dedup, the filtered documents, then one document kept per
near-duplicate cluster (the smallest content hash, xxh3-64 of the text, so the same on every rerun, whatever the units or
machines); counts documents and tokens removed per filter. Memory on the place side is bounded as exact dedup's:
the work files are streamed a chunk at a time, band keys spilled to hash partitions (near_dup_clusters.py), and
what grows with the corpus is one bit per document plus the union-find forest of the documents with a
near-duplicate candidate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nightloom.sharding import near_dup
from nightloom.sharding.arrays import ArrayReader
from nightloom.sharding.docflags import DocFlags
from nightloom.sharding.job import ShardJob
from nightloom.sharding.near_dup_clusters import BandIndex
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


def _unit_chunks(work: Path, scans: list[ScanResult], bands: int | None):
    """(global index of the chunk's first document, meta, quality, band keys or None), a chunk at a time, in
    input order: a unit's meta, quality and bands files hold its documents in the same order."""
    g = 0
    for s in scans:
        if not s.meta:
            continue
        readers = [ArrayReader(work / s.meta, META_DTYPE), ArrayReader(work / s.quality, QUALITY_DTYPE)]
        if bands is not None:
            readers.append(ArrayReader(work / s.bands, bands_dtype(bands)))
        try:
            for chunk in readers[0].chunks():
                n = len(chunk)
                yield g, chunk, readers[1].read(n), (readers[2].read(n)["k"] if bands is not None else None)
                g += n
        finally:
            for r in readers:
                r.close()


def quality_removals(job: ShardJob, work: Path, scans: list[ScanResult], dup: DocFlags):
    """(removed: DocFlags of documents the filters or near-dup remove, after exact dedup; their counts) for the
    place step. Streams the units' work files; near-dup's band keys are spilled (near_dup_clusters.BandIndex)."""
    nd = job.sharding.near_dup
    removed = DocFlags(dup.n)
    docs = np.zeros(len(FILTER_NAMES) + 1, dtype=np.int64)  # per code (0: kept)
    tokens = np.zeros(len(FILTER_NAMES) + 1, dtype=np.int64)
    index = BandIndex(nd.bands, dup.n, work / "near-dup-partitions") if nd is not None else None
    try:
        for g, m, q, keys in _unit_chunks(work, scans, nd.bands if nd is not None else None):
            exact = dup.get(g, len(m))
            code = np.where(exact, 0, q["code"])  # exact duplicates are counted as such, not again here
            docs += np.bincount(code, minlength=len(docs))
            tokens += np.bincount(code, weights=m["tokens"], minlength=len(docs)).astype(np.int64)
            removed.set(g + np.flatnonzero(code))
            if index is not None:
                live = np.flatnonzero((q["has"] != 0) & ~exact & (code == 0))
                index.add(g + live, keys[live], q["key"][live])
        near = index.removed() if index is not None else None
    finally:
        if index is not None:
            index.abort()
    counts = QualityCounts()
    on = job.sharding.filters.enabled() if job.sharding.filters is not None else []
    for k, name in enumerate(FILTER_NAMES):
        if name in on:
            counts.removed[name] = Removed(documents=int(docs[k + 1]), tokens=int(tokens[k + 1]))
    if near is not None:
        flags = DocFlags(dup.n)
        flags.set(near)
        near_tokens = sum(
            int(m["tokens"][flags.get(g, len(m))].sum()) for g, m, _, _ in _unit_chunks(work, scans, None)
        )
        counts.removed["near_dup"] = Removed(documents=len(near), tokens=near_tokens)
        removed.set(near)
    return removed, counts
