"""The embedded sample corpus: deterministic, real text of varied length, JSONL, built atomically once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nightloom.sharding.corpus import build_sample_corpus, ensure_sample_corpus


@pytest.fixture(scope="module")
def corpus():
    """The checkout's own sample corpus (datasets/sample/corpus.jsonl): built here on first use, or by whichever
    demo ran first; one build (~20 s on 2 cores) serves the whole suite."""
    return ensure_sample_corpus(Path(__file__).resolve().parents[3] / "datasets" / "sample" / "corpus.jsonl")


def test_corpus_is_jsonl_of_varied_real_text(corpus):
    recs = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    size = corpus.stat().st_size
    assert 1_000_000 < size < 8_000_000, size  # "a few MB"
    assert len(recs) > 2000
    assert all(set(r) == {"id", "text"} and r["text"].strip() for r in recs)
    assert len({r["id"] for r in recs}) == len(recs)  # ids are unique
    lengths = sorted(len(r["text"]) for r in recs)
    assert lengths[len(lengths) // 2] * 10 < lengths[-1]  # heavy tail: varied length
    assert any("json" in r["id"] for r in recs)  # stdlib docstrings, not random bytes
    assert len({r["text"] for r in recs}) < len(recs)  # has exact duplicates (exercises dedup)


@pytest.mark.slow
def test_corpus_is_deterministic_and_not_rebuilt(corpus, tmp_path):
    again = build_sample_corpus(tmp_path / "again.jsonl", max_bytes=300_000)  # same records, same order
    head = again.read_bytes()
    assert len(head) > 300_000 and corpus.read_bytes()[: len(head)] == head
    mtime = corpus.stat().st_mtime_ns
    assert ensure_sample_corpus(corpus) == corpus
    assert corpus.stat().st_mtime_ns == mtime
    # no temp file left by the build (in this test's own folder: datasets/sample/ is shared with the other xdist
    # worker, which may be writing its own `.corpus.jsonl.*.tmp` there at this moment, as a CI run showed)
    assert [p.name for p in tmp_path.iterdir()] == ["again.jsonl"]


def test_corpus_size_cap_and_bad_name(tmp_path):
    small = build_sample_corpus(tmp_path / "small.jsonl", max_bytes=50_000)
    text_bytes = sum(len(json.loads(x)["text"].encode()) for x in small.read_text().splitlines())
    assert 50_000 <= text_bytes < 50_000 + 20_000
    with pytest.raises(ValueError, match="JSONL"):
        ensure_sample_corpus(tmp_path / "corpus.parquet")
