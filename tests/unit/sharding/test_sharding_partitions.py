"""Spills split by plain shard: a writer reads only the partitions that hold its rows, rebalancing moves few
buckets, and where partitions meet (moved buckets, the held-out split) the shard still holds its documents in
input order, with token files that megatron-core reads as the tokenizer's ids + EOS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import xxhash

from nightloom.sharding import shard_dataset
from nightloom.sharding import write as write_module
from nightloom.sharding.balance import balance, imbalance, lpt_mapping, move_mapping, plain_mapping, shard_loads
from nightloom.sharding.write import partitions_of
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from nightloom.tokenizer import load_tokenizer
from tests.support.sharding import make_docs, small_bpe, write_jsonl

indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _skewed(rng: np.random.Generator, buckets: int) -> np.ndarray:
    w = (rng.pareto(1.5, size=buckets) * 1000).astype(np.int64)
    w[rng.random(buckets) < 0.1] = 0  # some empty buckets
    return w


@pytest.mark.slow
def test_move_mapping_reaches_the_target_moving_few_buckets_and_is_deterministic():
    rng = np.random.default_rng(3)
    reached = 0
    for trial in range(40):
        n = int(rng.integers(2, 33))
        w = _skewed(rng, n * 1024)
        m = move_mapping(w, n, 0.005)
        assert np.array_equal(m, move_mapping(w.copy(), n, 0.005))
        lpt = imbalance(shard_loads(lpt_mapping(w, n), w, n))
        if lpt <= 0.01:  # whenever LPT reaches the tolerance, so does balance() (the greedy, or LPT after it)
            _, _, after, _, _ = balance(w, n, 0.01, "tokens", docs=int(w.sum()))
            assert after <= 0.01, (trial, after)
        if imbalance(shard_loads(m, w, n)) <= 0.005:
            reached += 1
            moved = int((m != plain_mapping(n, len(w))).sum())
            assert moved <= 0.06 * int((w > 0).sum()), (trial, moved)  # most buckets stay on their plain shard
            assert np.mean([len(partitions_of(m, i, n, False)) for i in range(n)]) <= 4, trial
    assert reached >= 20, reached


def test_partitions_of_a_plain_mapping_are_the_shard_itself_and_all_for_the_heldout_split():
    plain = plain_mapping(4, 4 * 16)
    assert [partitions_of(plain, i, 4, False).tolist() for i in range(4)] == [[0], [1], [2], [3]]
    moved = plain.copy()
    moved[1] = 0  # bucket 1 (plain shard 1) now on shard 0
    assert partitions_of(moved, 0, 4, False).tolist() == [0, 1]
    assert partitions_of(moved, 4, 4, True).tolist() == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> TokenizerSpec:
    return small_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("path", ["fast", "record"])
@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_rebalanced_shards_keep_input_order_and_token_files_where_partitions_meet(tmp_path, request, which, path):
    docs = make_docs(3000, seed=5, skew=True, dup_every=7)
    src = write_jsonl(tmp_path / "skew.jsonl", docs)  # every line has an "id"; keeping it takes the record path
    spec = request.getfixturevalue("bpe") if which == "bpe" else TokenizerSpec.coerce("bytes")
    tok = load_tokenizer(spec)
    dataset = DatasetSpec(path=str(src), keep_columns=["id"] if path == "record" else [])
    sharding = ShardingSpec(output=str(tmp_path / "o"), num_shards=8, tolerance=0.01, heldout=0.05, salt="s")
    m = shard_dataset(dataset, sharding, workers=2, tokenizer=spec)
    assert m.rebalanced and m.imbalance <= 0.01 < m.imbalance_before_rebalance
    first = {}
    for i, d in enumerate(docs):
        first.setdefault(d, i)
    mixed = 0
    seen = []
    for s in m.shards + [m.heldout]:
        texts = pq.read_table(tmp_path / "o" / s.path).column("text").to_pylist()
        where = [first[t] for t in texts]
        assert where == sorted(where) and len(set(where)) == len(where), s.path  # input order, each once
        plain = {xxhash.xxh64_intdigest(t.encode() + b"s") % 8 for t in texts}
        mixed += len(plain) > 1  # this shard's rows came from more than one spill partition
        ds = indexed.IndexedDataset(str(tmp_path / "o" / s.token_files.prefix))
        assert len(ds) == len(texts)
        for k in range(0, len(texts), 7):
            assert ds[k].tolist() == tok.encode(texts[k]) + [tok.eos_id], (s.path, k)
        seen += texts
    assert mixed >= 2, "no shard merged partitions: the test would not see an order bug"
    assert sorted(seen) == sorted(first)


def test_each_spilled_row_is_read_by_one_writer_under_plain_hashing(tmp_path, monkeypatch):
    """The writers together read each spilled batch once (before, each of N writers read every spill)."""
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(4000, seed=9, dup_every=11))
    read = []
    real = write_module.read_spilled_batches

    def counting(*args):
        batches = real(*args)
        read.append(sum(b.num_rows for b in batches))
        return batches

    monkeypatch.setattr(write_module, "read_spilled_batches", counting)
    sharding = ShardingSpec(output=str(tmp_path / "o"), num_shards=8, tolerance=0.9)
    m = shard_dataset(DatasetSpec(path=str(src)), sharding, workers=2)
    assert not m.rebalanced
    spilled = m.rows + m.dedup_dropped
    assert m.rows <= sum(read) <= spilled, (sum(read), m.rows, spilled)


@pytest.mark.slow
def test_a_unit_of_many_spill_parts_keeps_one_spill_file_open_per_writer(tmp_path):
    """A compressed file is one scan unit however big; each of its spill parts is opened by the writers one at a
    time, so a unit of 600 parts shards under a 128-descriptor limit (a subprocess: the limit is process-wide)."""
    src = write_jsonl(tmp_path / "big.jsonl.gz", make_docs(10000, seed=1), compress="gz")
    code = (
        "import resource, sys\n"
        "from nightloom.sharding import jsonl_pieces, scan_arrow, shard_dataset, spill\n"
        "from nightloom.spec import DatasetSpec, ShardingSpec\n"
        "spill.SPILL_PART_BYTES = jsonl_pieces.JSON_CHUNK = scan_arrow.JSON_BLOCK = 2000\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))\n"
        "parts = []\n"
        "finish = spill.Spill.finish\n"
        "spill.Spill.finish = lambda self: (r := finish(self), parts.append(len(r[0])))[0]\n"
        "sh = ShardingSpec(output=sys.argv[2], num_shards=4, tolerance=0.9)\n"
        "m = shard_dataset(DatasetSpec(path=sys.argv[1]), sh, workers=4)\n"
        "print(sum(parts), m.rows)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    parts, rows = map(int, r.stdout.split())
    assert parts >= 600 and rows > 0, (parts, rows)


def test_documents_the_tokenizer_turns_into_no_ids_still_shard(tmp_path, bpe, monkeypatch):
    """A normalizer that deletes '~' leaves a unit whose documents have no ids at all (an empty ids spill)."""
    from tokenizers import Tokenizer, normalizers

    from nightloom.sharding import prepare

    monkeypatch.setattr(prepare, "UNIT_BYTES", 1)  # every file a scan unit of its own

    folder = tmp_path / "tok"
    folder.mkdir()
    tok = Tokenizer.from_file(str(Path(bpe.path) / "tokenizer.json"))
    tok.normalizer = normalizers.Replace("~", "")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    spec = TokenizerSpec(path=str(folder))
    src = tmp_path / "in"
    write_jsonl(src / "a.jsonl", ["~" * k for k in range(1, 9)])  # a unit of its own whose texts all vanish
    write_jsonl(src / "b.jsonl", make_docs(200, seed=4))
    m = shard_dataset(
        DatasetSpec(path=str(src), keep_columns=["id"]),
        ShardingSpec(output=str(tmp_path / "o"), num_shards=2, tolerance=0.9),
        workers=2,
        tokenizer=spec,
    )
    eos = load_tokenizer(spec).eos_id
    seen = 0
    for s in m.shards:
        texts = pq.read_table(tmp_path / "o" / s.path).column("text").to_pylist()
        ds = indexed.IndexedDataset(str(tmp_path / "o" / s.token_files.prefix))
        for k, text in enumerate(texts):
            if set(text) == {"~"}:
                assert ds[k].tolist() == [eos]
                seen += 1
    assert seen == 8


def test_a_writer_that_fails_to_open_a_scans_files_leaves_nothing_open(tmp_path):
    """A shard writer opens each scan's per-row files and spill parts itself (preads, no memmaps); when one of them
    is missing it fails naming it, and every descriptor it had opened is closed again."""
    import os

    from nightloom.sharding.place import place_documents
    from nightloom.sharding.prepare import plan_job
    from nightloom.sharding.scan import scan_unit
    from nightloom.sharding.write import write_shard

    src = write_jsonl(tmp_path / "a.jsonl", make_docs(600, seed=4))
    job = plan_job(DatasetSpec(path=str(src)), ShardingSpec(output=str(tmp_path / "o"), num_shards=3, tolerance=0.9))
    scans = [scan_unit(job, i) for i in range(len(job.units))]
    place_documents(job, scans)
    (job.work.local / scans[0].meta).unlink()
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError, match=scans[0].meta):
        write_shard(job, scans, 0)
    assert sorted(os.listdir("/proc/self/fd")) == before
