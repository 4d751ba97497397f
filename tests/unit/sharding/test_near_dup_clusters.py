"""near_dup_clusters.py: band keys spilled to hash partitions and a union-find forest over the documents with an
edge remove exactly what near_dup.near_duplicates removes in memory, with one partition or many, the forest
folded once or many times, documents added in any batches; the partition files are gone afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from nightloom.sharding import near_dup_clusters as ndc
from nightloom.sharding.near_dup import MinHashParams, Signer, band_keys, content_keys, near_duplicates
from nightloom.sharding.planted import planted_corpus


@pytest.fixture(scope="module")
def signed():
    texts = planted_corpus(120, seed=11).texts
    p = MinHashParams()
    sigs, has = Signer(p).sign(texts)
    return texts, band_keys(sigs, p), has, content_keys(texts), near_duplicates(texts)


def _spilled(signed, tmp_path, parts_docs: int, compact: int, batch: int) -> np.ndarray:
    texts, keys, has, content, _ = signed
    index = ndc.BandIndex(keys.shape[1], parts_docs, tmp_path / "nd", compact_edges=compact)
    for lo in range(0, len(texts), batch):
        live = lo + np.flatnonzero(has[lo : lo + batch])
        index.add(live, keys[live], content[live])
    removed = np.zeros(len(texts), dtype=bool)
    removed[index.removed()] = True
    return removed


@pytest.mark.parametrize(
    ("parts_docs", "compact", "batch"),
    [(1, 1 << 20, 10_000), (ndc.PARTITION_RECORDS, 1, 37), (3 * ndc.PARTITION_RECORDS, 50, 100)],
)
def test_spilled_clusters_equal_the_in_memory_ones(signed, tmp_path, parts_docs, compact, batch):
    want = signed[-1]
    assert 30 < want.sum() < len(want) / 2  # the planted corpus has near-duplicates to find, and originals
    got = _spilled(signed, tmp_path, parts_docs, compact, batch)
    assert np.array_equal(got, want)
    assert not (tmp_path / "nd").exists()  # partition files removed


def test_partitions_spill_to_disk_past_one(tmp_path):
    index = ndc.BandIndex(14, 2 * ndc.PARTITION_RECORDS // 14 + 1, tmp_path / "nd")
    assert index.parts == 3
    keys = np.random.default_rng(0).integers(0, 2**63, size=(50, 14), dtype=np.uint64)
    index.add(np.arange(50), keys, np.arange(50, dtype=np.uint64))
    index.add(np.arange(50, 60), keys[:10], np.arange(10, dtype=np.uint64))  # 50..59 copy 0..9's bands
    assert len(list((tmp_path / "nd").glob(".part-*.bin.tmp"))) == 3  # written as they come
    # each copy has content hash equal to its original's index, so (content, index) keeps the original
    assert index.removed().tolist() == list(range(50, 60))


def test_forest_keeps_smallest_content_per_component():
    f = ndc.Forest(compact_edges=1)
    c = {1: 9, 2: 3, 3: 7, 7: 3, 8: 1, 9: 5}
    for u, v in [(1, 2), (2, 3), (7, 3), (8, 9)]:
        f.add(np.array([u]), np.array([v]), np.array([c[u]], dtype=np.uint64), np.array([c[v]], dtype=np.uint64))
    # components {1, 2, 3, 7}: content 3 twice, the smaller index (2) kept; {8, 9}: 8 (content 1) kept
    assert f.removed().tolist() == [1, 3, 7, 9]


def test_streamed_texts_remove_what_near_duplicates_removes(signed, tmp_path):
    texts, want = signed[0], signed[-1]
    got = ndc.near_duplicates_streamed(enumerate(texts), len(texts), tmp_path / "nd", batch=64)
    assert got.tolist() == np.flatnonzero(want).tolist()
    # a subset (as after the filters) keeps its global indexes
    odd = [(i, t) for i, t in enumerate(texts) if i % 2]
    sub = near_duplicates([t for _, t in odd])
    got = ndc.near_duplicates_streamed(iter(odd), len(texts), tmp_path / "nd", batch=50)
    assert got.tolist() == [odd[k][0] for k in np.flatnonzero(sub)] and len(got)
