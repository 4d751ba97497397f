"""Near-duplicate clusters over a corpus larger than memory: LSH band keys spilled into hash partitions, edges
found one partition at a time, union-find over the documents that have an edge.

As the exact dedup (place.duplicate_mask): documents sharing a band key share its hash, so (band key, document,
content hash) records are split into partitions by the key's high bits, written to work files when there is more
than one partition, and each partition is sorted and read alone (PARTITION_RECORDS records, ~24 MiB, at a time).
A key is salted by its band, so partitions mix bands. Each run of equal keys in a partition gives a star of edges
to its smallest document; the edges go into a union-find forest over the documents that have one (`Forest`), so
what is held for the whole corpus is proportional to its near-duplicates, not to its documents. The result is
near_dup.near_duplicates's: the same components, and per cluster the document with the smallest (content hash,
global index) kept.
"""

from __future__ import annotations

import itertools
import math
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from nightloom.sharding import near_dup
from nightloom.sharding.arrays import ArrayReader, ArrayWriter

RECORD = np.dtype([("key", "<u8"), ("doc", "<i8"), ("content", "<u8")])
PARTITION_RECORDS = 1 << 20  # records sorted in memory at once (24 MiB, and the sort's index)
MAX_PARTITIONS = 512  # open partition files at most
COMPACT_EDGES = 1 << 20  # pending edges before the forest is recomputed (more when the forest is larger)
_SALT = np.random.RandomState(0x6E64).randint(0, 2**63, size=1024, dtype=np.uint64)  # per band (num_perm <= 1024)


class Forest:
    """Connected components of the edges seen so far, held as each touched document's root (nodes sorted), with
    its content hash; new edges wait in a list until there are more than the forest, then are folded in."""

    def __init__(self, compact_edges: int = COMPACT_EDGES):
        self.nodes = np.zeros(0, dtype=np.int64)  # documents with an edge, sorted
        self.content = np.zeros(0, dtype=np.uint64)  # their content hashes
        self.roots = np.zeros(0, dtype=np.int64)  # their component's smallest document
        self.pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.waiting, self.compact_edges = 0, compact_edges

    def add(self, u: np.ndarray, v: np.ndarray, cu: np.ndarray, cv: np.ndarray) -> None:
        """Edges u[i]—v[i] between documents whose content hashes are cu[i], cv[i]."""
        if len(u):
            self.pending.append((u, v, cu, cv))
            self.waiting += len(u)
            if self.waiting > max(self.compact_edges, len(self.nodes)):
                self.compact()

    def compact(self) -> None:
        """Fold the pending edges in: components over the forest's (node, root) links and the new edges."""
        if not self.pending:
            return
        u, v, cu, cv = (np.concatenate(x) for x in zip(*self.pending, strict=True))
        self.pending, self.waiting = [], 0
        every = np.concatenate([self.nodes, u, v])
        nodes, first = np.unique(every, return_index=True)
        content = np.concatenate([self.content, cu, cv])[first]
        a = np.concatenate([np.searchsorted(nodes, self.nodes), np.searchsorted(nodes, u)])
        b = np.concatenate([np.searchsorted(nodes, self.roots), np.searchsorted(nodes, v)])
        labels = near_dup.components(len(nodes), [(a, b)])
        self.nodes, self.content, self.roots = nodes, content, nodes[labels]

    def removed(self) -> np.ndarray:
        """Sorted documents to remove: all but the smallest (content hash, document) of each component."""
        self.compact()
        labels = np.searchsorted(self.nodes, self.roots)
        return self.nodes[~near_dup.keep_one(labels, self.content)]


def star_edges(part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indexes (i, j) into `part` (RECORD) joining each record to the first of its run of equal keys, records
    sorted by (key, doc) so the first is the smallest document."""
    order = np.lexsort((part["doc"], part["key"]))
    k = part["key"][order]
    starts = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
    head = np.repeat(starts, np.diff(np.append(starts, len(k))))
    other = np.flatnonzero(head != np.arange(len(k)))
    return order[head[other]], order[other]


class BandIndex:
    """Band keys of live documents (global index, content hash), in memory while they fit one partition, else
    in hash-partition work files under `folder`; `removed()` gives the near-duplicates to drop."""

    def __init__(self, bands: int, expected_docs: int, folder: Path, compact_edges: int = COMPACT_EDGES):
        self.bands, self.folder, self.compact_edges = bands, Path(folder), compact_edges
        self.parts = min(MAX_PARTITIONS, max(1, math.ceil(expected_docs * bands / PARTITION_RECORDS)))
        self.memory: list[np.ndarray] = []
        self.writers: list[ArrayWriter] = []
        if self.parts > 1:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.writers = [ArrayWriter(self._part(i), RECORD) for i in range(self.parts)]

    def _part(self, i: int) -> Path:
        return self.folder / f"part-{i:04d}.bin"

    def add(self, docs: np.ndarray, keys: np.ndarray, content: np.ndarray) -> None:
        """Documents `docs` (global indexes) with band keys `keys` (n, bands) and content hashes `content`."""
        n = len(docs)
        if not n:
            return
        rec = np.empty((n, self.bands), dtype=RECORD)
        rec["key"] = keys ^ _SALT[: self.bands]
        rec["doc"] = np.asarray(docs, dtype=np.int64)[:, None]
        rec["content"] = np.asarray(content, dtype=np.uint64)[:, None]
        rec = rec.reshape(-1)
        if self.parts == 1:
            self.memory.append(rec)
            return
        which = (rec["key"] >> np.uint64(40)) % np.uint64(self.parts)
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(self.parts + 1, dtype=np.uint64))
        for i in np.flatnonzero(np.diff(bounds)):
            self.writers[i].append(rec[order[bounds[i] : bounds[i + 1]]])

    def _partitions(self):
        if self.parts == 1:
            yield np.concatenate(self.memory) if self.memory else np.zeros(0, dtype=RECORD)
            self.memory = []
            return
        for w in self.writers:
            w.publish()
        self.writers = []
        for i in range(self.parts):
            with ArrayReader(self._part(i), RECORD) as r:
                yield r.read(r.count)

    def removed(self) -> np.ndarray:
        """Sorted global indexes of the documents near-dup removes (all but one of each cluster)."""
        forest = Forest(self.compact_edges)
        try:
            for part in self._partitions():
                i, j = star_edges(part)
                forest.add(part["doc"][i], part["doc"][j], part["content"][i], part["content"][j])
        finally:
            self.abort()
        return forest.removed()

    def abort(self) -> None:
        """Drop the work files (after `removed`, or on an error)."""
        for w in self.writers:
            w.abort()
        self.writers, self.memory = [], []
        shutil.rmtree(self.folder, ignore_errors=True)


def near_duplicates_streamed(
    docs: Iterable[tuple[int, str]],
    expected_docs: int,
    folder: Path,
    params: near_dup.MinHashParams | None = None,
    batch: int = 512,
) -> np.ndarray:
    """Sorted indexes of the near-duplicates among `docs` ((index, text) pairs, read once, `batch` at a time):
    near_dup.near_duplicates's result, with no text or per-document object kept past its batch."""
    params = params if params is not None else near_dup.MinHashParams()
    signer = near_dup.Signer(params)
    index = BandIndex(params.bands, expected_docs, folder)
    it = iter(docs)
    try:
        while chunk := list(itertools.islice(it, batch)):
            ids = np.fromiter((i for i, _ in chunk), dtype=np.int64, count=len(chunk))
            texts = [t for _, t in chunk]
            sigs, has = signer.sign(texts)
            index.add(ids[has], near_dup.band_keys(sigs[has], params), near_dup.content_keys(texts)[has])
        return index.removed()
    finally:
        index.abort()
