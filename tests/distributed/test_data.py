"""Packed data through the manifest: layout-independent step batches, lazy shard reads, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from nightloom.train.data import SEPARATOR, DataError, PackedWindows, StepLoader, pack_documents


def test_packing_puts_a_separator_after_each_document():
    assert pack_documents(["ab", "é"]).tolist() == [97, 98, SEPARATOR, 0xC3, 0xA9, SEPARATOR]


def test_step_batch_is_the_same_set_of_sequences_for_any_dp_size(corpus):
    w = PackedWindows(str(corpus / "manifest.json"), seq_len=32)
    for step in (0, 3, 1000):  # 1000 wraps around the epoch
        one = StepLoader(w, micro_batch=8, grad_accum=1, dp=1, dp_rank=0).batch(step)
        for dp, mb, ga in ((2, 2, 2), (4, 1, 2), (8, 1, 1)):
            parts = [StepLoader(w, mb, ga, dp, r).batch(step) for r in range(dp)]
            assert all(len(p.micro) == ga for p in parts)  # every rank runs the same number of micro-batches
            torch.testing.assert_close(torch.cat([p.inputs for p in parts]), one.inputs, rtol=0, atol=0)
    b = one.micro[0]
    torch.testing.assert_close(b[0][:, 1:], b[1][:, :-1], rtol=0, atol=0)  # targets = inputs shifted by one


def test_a_rank_reads_only_the_shards_its_slice_touches(corpus):
    w = PackedWindows(str(corpus), seq_len=32)
    StepLoader(w, 2, 1, 4, 0).batch(0)
    assert list(w._cache) == [0]


def test_manifest_that_overstates_tokens_is_reported_with_the_shard(corpus, tmp_path):
    m = json.loads((corpus / "manifest.json").read_text())
    m["shards"][0]["tokens"] *= 3
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    for s in m["shards"]:
        (tmp_path / s["path"]).write_bytes((corpus / s["path"]).read_bytes())
    w = PackedWindows(str(tmp_path), seq_len=32)
    with pytest.raises(DataError, match=r"shard-00000.parquet: manifest field shards\[0\]"):
        w.windows(0, 1)


def test_missing_shard_and_too_short_corpus_are_clear(corpus, tmp_path):
    (tmp_path / "manifest.json").write_text((corpus / "manifest.json").read_text())
    with pytest.raises(DataError, match="shard listed in the manifest does not exist"):
        PackedWindows(str(tmp_path), seq_len=32).windows(0, 1)
    with pytest.raises(DataError, match="do not fill one window"):
        PackedWindows(str(corpus), seq_len=10**7)


def test_seeded_windows_are_a_permutation_within_each_shard(corpus):
    plain = PackedWindows(str(corpus), seq_len=32)
    mixed = PackedWindows(str(corpus), seq_len=32, seed=7)
    again = PackedWindows(str(corpus), seq_len=32, seed=7)
    for span in plain.spans:
        a = plain.windows(span.first, span.count)
        b = mixed.windows(span.first, span.count)
        assert torch.equal(b, again.windows(span.first, span.count))  # deterministic
        assert not torch.equal(a, b) or span.count < 2  # reordered
        assert sorted(map(tuple, a.tolist())) == sorted(map(tuple, b.tolist()))  # same windows, same shard
