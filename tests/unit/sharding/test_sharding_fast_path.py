"""The Arrow fast path's building blocks: zero-copy line pieces, the prefetch thread, blank detection, codecs."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nightloom.sharding import jsonl_pieces
from nightloom.sharding.jsonl_pieces import line_chunks
from nightloom.sharding.scan_arrow import _blank_rows, _prefetched
from nightloom.spec import DatasetSpec, ShardingSpec
from tests.support.sharding import make_docs, write_jsonl


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("ending", [b"\n", b""])
def test_line_pieces_reassemble_the_file_exactly_and_end_on_newlines(tmp_path, size, ending):
    rng = random.Random(size)
    lines = [("x" * rng.choice([0, 1, 5, 40, 300])).encode() for _ in range(200)]
    body = b"\n".join(lines + [b'{"last": 1}']) + ending
    path = tmp_path / "a.jsonl"
    path.write_bytes(body)
    pieces = [p.to_pybytes() for p in line_chunks(path, size=size)]
    assert b"".join(pieces) == body
    assert all(p.endswith(b"\n") for p in pieces[:-1])
    if ending:
        assert pieces[-1].endswith(b"\n")


def test_line_pieces_of_a_long_line_search_past_the_tail_window(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl_pieces, "NEWLINE_SEARCH", 4)
    body = b"a" * 50 + b"\n" + b"b" * 30 + b"\n"
    path = tmp_path / "a.jsonl"
    path.write_bytes(body)
    pieces = [p.to_pybytes() for p in line_chunks(path, size=70)]
    assert pieces == [b"a" * 50 + b"\n", b"b" * 30 + b"\n"]


def test_prefetch_keeps_order_and_reraises_the_producers_error():
    def items():
        yield from range(5)
        raise ValueError("broken at item 5")

    got = []
    with pytest.raises(ValueError, match="broken at item 5"):
        got.extend(_prefetched(items()))  # extend keeps what arrived before the error
    assert got == [0, 1, 2, 3, 4]


def test_prefetch_stops_its_thread_when_the_consumer_stops_early():
    before = threading.active_count()
    gen = _prefetched(iter(range(1000)))
    assert next(gen) == 0
    gen.close()  # e.g. the fast path gave up on this file
    assert threading.active_count() == before


def _blank_by_python(docs: list[str]) -> list[bool]:
    return [not d or d.isspace() for d in docs]


def test_blank_rows_agree_with_str_isspace():
    rng = random.Random(3)
    pool = [
        "",
        " ",
        "\t\n",
        "\u3000",
        "\u00a0 ",
        "\u2003\t",
        "\x1c",
        "\x85",
        "a",
        "数据",
        " x",
        "\u3000数",
        "λ",
        "\ufeff",
    ]
    docs = ["".join(rng.choice(pool) for _ in range(rng.randint(0, 4))) for _ in range(3000)]
    docs += ["\u3000" * 50, " " * 100 + "z", "数" * 10]
    arr = pa.array(docs, type=pa.large_string())
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[: len(docs) + 1]
    mv = memoryview(arr.buffers()[2])
    got = _blank_rows(offsets, np.frombuffer(mv, dtype=np.uint8), mv)
    assert got.tolist() == _blank_by_python(docs)


@pytest.mark.parametrize("codec", ["zstd", "snappy", "none"])
def test_shard_codec_is_applied_recorded_and_part_of_the_settings(tmp_path, codec):
    from nightloom.sharding import load_manifest, shard_dataset
    from tests.support.sharding import read_shard

    src = write_jsonl(tmp_path / "a.jsonl", make_docs(400, seed=5))
    out = tmp_path / codec
    m = shard_dataset(
        DatasetSpec(path=str(src)), ShardingSpec(output=str(out), num_shards=2, tolerance=0.2, compression=codec)
    )
    assert m.compression == codec and load_manifest(str(out / "manifest.json")).compression == codec
    meta = pq.ParquetFile(out / m.shards[0].path).metadata
    expected = "UNCOMPRESSED" if codec == "none" else codec.upper()
    assert meta.row_group(0).column(0).compression == expected
    assert sum(len(read_shard(str(out), s.index)) for s in m.shards) == m.rows
    other = shard_dataset(
        DatasetSpec(path=str(src)),
        ShardingSpec(
            output=str(tmp_path / "other"), num_shards=2, tolerance=0.2, compression="lz4" if codec != "lz4" else "zstd"
        ),
    )
    assert other.settings_hash != m.settings_hash


def test_partitioned_dedup_gives_the_same_shards_as_in_memory(tmp_path, monkeypatch):
    """Above PARTITION_DOCS documents dedup runs per hash partition through work files; the shards (and the
    manifest's counts) must be byte-identical to the single in-memory partition."""
    from nightloom.sharding import place, shard_dataset
    from tests.support.sharding import tree_bytes

    docs = make_docs(1200, seed=4, dup_every=5)
    src = tmp_path / "in"
    write_jsonl(src / "a.jsonl", docs[:700])
    write_jsonl(src / "b.jsonl", docs[700:] + docs[:50])  # duplicates across files: the first file's copy wins
    spec = dict(num_shards=3, tolerance=0.1)
    one = shard_dataset(DatasetSpec(path=str(src)), ShardingSpec(output=str(tmp_path / "one"), **spec))
    monkeypatch.setattr(place, "PARTITION_DOCS", 100)  # 12 partitions
    many = shard_dataset(DatasetSpec(path=str(src)), ShardingSpec(output=str(tmp_path / "many"), **spec))
    assert one.dedup_dropped == many.dedup_dropped >= 50 + 1200 // 5 - 5
    assert tree_bytes(tmp_path / "one") == tree_bytes(tmp_path / "many")


def test_array_files_refuse_truncation(tmp_path):
    from nightloom.sharding.arrays import DEST_DTYPE, ArrayReader, ArrayWriter

    w = ArrayWriter(tmp_path / "d.bin", DEST_DTYPE)
    w.append(np.arange(10))
    assert w.publish() == 10 and not (tmp_path / ".d.bin.tmp").exists()
    with ArrayReader(tmp_path / "d.bin", DEST_DTYPE) as r:
        assert r.read(4).tolist() == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="wanted 7 more records"):
            r.read(7)
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-1])
    with pytest.raises(ValueError, match="not a whole number"):
        ArrayReader(tmp_path / "d.bin", DEST_DTYPE)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: nothing to widen")
def test_the_scan_parses_on_every_cpu_even_with_omp_num_threads_1(tmp_path):
    """Arrow sizes its CPU pool (the JSONL parse) from OMP_NUM_THREADS, which torchrun, CI and the Makefile set
    to 1; the scan widens it again (a subprocess: the pool is process-wide)."""
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(50))
    code = (
        "import sys, pyarrow as pa\n"
        "from nightloom.sharding import shard_dataset\n"
        "from nightloom.spec import DatasetSpec, ShardingSpec\n"
        "before = pa.cpu_count()\n"
        "shard_dataset(DatasetSpec(path=sys.argv[1]), ShardingSpec(output=sys.argv[2], num_shards=2, tolerance=0.9))\n"
        "print(before, pa.cpu_count())\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", code, str(src), str(tmp_path / "o")], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    before, after = map(int, r.stdout.split())
    assert before == 1 and after == min(os.cpu_count(), 8)


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20])
def test_line_pieces_of_spans_and_of_a_gzip_stream_reassemble_exactly(tmp_path, size):
    """Consecutive line-aligned spans of a plain file read each line once (pieces seek back over a partial line);
    a gzip stream, which cannot seek, joins it to the next read instead: both give the same bytes."""
    import gzip

    from nightloom.sharding.jsonl_pieces import line_span

    rng = random.Random(size)
    body = b"".join(("y" * rng.choice([0, 3, 40, 500])).encode() + b"\n" for _ in range(300)) + b"tail"
    path = tmp_path / "a.jsonl"
    path.write_bytes(body)
    cuts = [0, 1, 777, 778, 5000, len(body) // 2, len(body)]
    got = b""
    for a, b in zip(cuts, cuts[1:]):
        lo, hi = line_span(path, a, b)
        pieces = [p.to_pybytes() for p in line_chunks(path, size=size, span=(lo, hi))]
        assert b"".join(pieces) == body[lo:hi] and all(p.endswith(b"\n") for p in pieces[:-1])
        got += body[lo:hi]
    assert got == body
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(body))
    assert b"".join(p.to_pybytes() for p in line_chunks(gz, size=size)) == body


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_a_shard_run_does_not_import_pandas(tmp_path, tokenizer):
    """pa.array and pa.scalar on numpy or Python values first import pandas (to ask whether they were given a
    Series): 0.2-0.6 s of a core with the GIL held, in every process and Dask worker that shards. The sharder
    builds its Arrow values from buffers: a run that drops duplicates and rebalances (every `take`) imports none."""
    from tests.support.sharding import small_bpe

    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs(600, dup_every=7, skew=True))
    tok = small_bpe(tmp_path / "bpe").path if tokenizer == "bpe" else None
    code = f"""
import sys
from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
tok = TokenizerSpec(path={tok!r}) if {tok!r} else None
m = shard_dataset(DatasetSpec(path={str(corpus)!r}), ShardingSpec(output={str(tmp_path / "out")!r}, num_shards=4,
                  tolerance=0.005), workers=2, tokenizer=tok)
assert m.dedup_dropped and m.rebalanced, (m.dedup_dropped, m.rebalanced)
print("pandas" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False"], r.stdout
