"""Hash sharding end to end on small corpora: determinism, hashing formula, dedup, balance, re-run, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from nightloom.sharding import (
    BadInputError,
    ShardingError,
    TooSmallError,
    load_manifest,
    shard_dataset,
)
from nightloom.sharding.balance import imbalance
from nightloom.spec import DatasetSpec, ShardingSpec
from tests.support.sharding import make_docs, read_shard, shard_texts, tree_bytes, write_jsonl, write_parquet

ROOT = Path(__file__).resolve().parents[3]


def _run(path, out, workers=1, progress=None, **kw):
    kw.setdefault("num_shards", 4)
    kw.setdefault("tolerance", 0.05)
    return shard_dataset(
        DatasetSpec(path=str(path)), ShardingSpec(output=str(out), **kw), workers=workers, progress=progress
    )


@pytest.fixture
def multi(tmp_path):
    """A folder of 5 inputs in 4 formats with cross-file duplicates."""
    docs = make_docs(1500, seed=1, dup_every=7)
    d = tmp_path / "in"
    write_jsonl(d / "a.jsonl", docs[:400])
    write_jsonl(d / "b.jsonl.gz", docs[400:700], compress="gz")
    write_jsonl(d / "c.jsonl.zst", docs[700:1000], compress="zst")
    write_parquet(d / "d.parquet", docs[1000:1300])
    write_jsonl(d / "sub" / "e.jsonl", docs[1300:] + docs[:5])  # 5 duplicates of the first file
    return d, docs


def test_byte_identical_across_runs_and_worker_counts(multi, tmp_path):
    src, _ = multi
    m1 = _run(src, tmp_path / "o1", workers=1)
    m3 = _run(src, tmp_path / "o3", workers=3)
    assert m1 == m3
    b1, b3 = tree_bytes(tmp_path / "o1"), tree_bytes(tmp_path / "o3")
    assert b1 == b3 and len(b1) == 1 + 4 * 3  # manifest + 4 shards (.parquet, .bin, .idx), nothing else left behind
    assert not (tmp_path / "o1" / ".nightloom-work").exists()
    assert [s.path for s in m1.sources] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "sub/e.jsonl"]


def test_every_document_lands_on_xxhash64_key_salt_mod_n(multi, tmp_path):
    src, _ = multi
    m = _run(src, tmp_path / "o", tolerance=0.9, salt="pepper")  # loose: plain hashing, no rebalancing
    assert not m.rebalanced and m.imbalance == m.imbalance_before_rebalance
    for i, texts in enumerate(shard_texts(tmp_path / "o")):
        for t in texts:
            assert xxhash.xxh64_intdigest(t.encode() + b"pepper") % 4 == i
    # a different salt moves documents
    m2 = _run(src, tmp_path / "o2", tolerance=0.9, salt="other")
    assert [s.sha256 for s in m2.shards] != [s.sha256 for s in m.shards]


def test_exact_dedup_keeps_first_and_counts(multi, tmp_path):
    src, docs = multi
    all_docs = docs + docs[:5]
    m = _run(src, tmp_path / "o")
    texts = [t for shard in shard_texts(tmp_path / "o") for t in shard]
    assert sorted(texts) == sorted(set(all_docs))
    assert m.dedup_dropped == len(all_docs) - len(set(all_docs)) > 0
    assert m.rows == len(set(all_docs))
    m2 = _run(src, tmp_path / "nd", dedup=False)
    assert m2.dedup_dropped == 0 and m2.rows == len(all_docs)
    # without dedup, identical keys still land in one shard
    where = {}
    for i, shard in enumerate(shard_texts(tmp_path / "nd")):
        for t in shard:
            assert where.setdefault(t, i) == i


def test_key_field_dedups_by_key(tmp_path):
    src = tmp_path / "k.jsonl"
    src.write_text("".join(f'{{"text": "text number {i}", "url": "u{i % 50}"}}\n' for i in range(200)))
    m = _run(src, tmp_path / "o", key_field="url", num_shards=2, tolerance=0.5)
    assert m.key == "url" and m.rows == 50 and m.dedup_dropped == 150
    table = read_shard(tmp_path / "o", 0)
    assert table.column_names == ["text", "url"]
    assert all(t == f"text number {int(u[1:])}" for t, u in zip(table["text"].to_pylist(), table["url"].to_pylist()))


@pytest.mark.parametrize("metric", ["tokens", "bytes", "rows"])
def test_rebalancing_a_skewed_corpus(tmp_path, metric):
    src = write_jsonl(tmp_path / "skew.jsonl", make_docs(3000, seed=5, skew=True))
    m = _run(src, tmp_path / "o", num_shards=8, tolerance=0.01, balance_by=metric)
    assert m.rebalanced and m.imbalance_before_rebalance > 0.01 >= m.imbalance, m
    # the figures in the manifest are the shards' real figures
    tables = [read_shard(tmp_path / "o", i) for i in range(8)]
    real = {
        "rows": [t.num_rows for t in tables],
        "tokens": [sum(len(x.encode()) for x in t["text"].to_pylist()) for t in tables],
    }
    real["bytes"] = real["tokens"]
    assert [s.rows for s in m.shards] == real["rows"]
    assert [s.tokens for s in m.shards] == real["tokens"]
    assert imbalance(np.array(real[metric])) == pytest.approx(m.imbalance, abs=1e-6)


def test_too_small_corpus_says_what_is_needed(tmp_path):
    src = tmp_path / "tiny.jsonl"
    src.write_text('{"text": "%s"}\n{"text": "short one"}\n{"text": "another short"}\n' % ("x" * 5000))
    with pytest.raises(TooSmallError) as e:
        _run(src, tmp_path / "o", num_shards=2, tolerance=0.02)
    msg = str(e.value)
    assert "need at least 500,000 tokens" in msg  # 2 shards × 5000-token document / 0.02
    assert "have 5,022 tokens in 3 documents" in msg
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_more_shards_than_documents(tmp_path):
    src = write_jsonl(tmp_path / "few.jsonl", ["a b c", "d e f", "a b c"])
    with pytest.raises(ShardingError, match=r"more shards \(3\) than documents \(2\)"):
        _run(src, tmp_path / "o", num_shards=3)


def test_empty_documents_and_files_are_skipped_and_counted(tmp_path):
    d = tmp_path / "in"
    write_jsonl(d / "a.jsonl", make_docs(100) + ["", "   "])
    (d / "empty.jsonl").write_bytes(b"")
    (d / "blank.txt").write_text("")
    (d / "doc.txt").write_text("a text file is one document")
    m = _run(d, tmp_path / "o", num_shards=2, tolerance=0.3)
    assert m.empty_skipped == 3 and m.rows == 101
    only_empty = tmp_path / "e"
    write_jsonl(only_empty / "x.jsonl", ["", ""])
    (only_empty / "y.jsonl").write_bytes(b"")
    with pytest.raises(BadInputError, match="zero documents in the whole input"):
        _run(only_empty, tmp_path / "o2")


def test_rerun_does_no_work_and_settings_change_replaces(multi, tmp_path):
    src, _ = multi
    out = tmp_path / "o"
    m1 = _run(src, out)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    m2 = _run(src, out)
    assert m2 == m1 and m2.settings_hash == m1.settings_hash
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps  # nothing rewritten
    m3 = _run(src, out, num_shards=3)
    assert m3.settings_hash != m1.settings_hash
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json"] + [f for s in m3.shards for f in s.files()]
    )
    assert load_manifest(out) == m3


def test_resume_after_interruption_reuses_finished_work(multi, tmp_path):
    src, _ = multi
    out = tmp_path / "o"

    def stop_after_two(stage, done, total):
        if stage == "write" and done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(src, out, progress=stop_after_two)
    assert not (out / "manifest.json").exists()  # readers see no dataset
    published = {p.name: p.stat().st_ino for p in out.glob("shard-*.parquet")}
    assert len(published) == 2
    assert not list(out.glob(".shard-*"))  # no partial shard visible
    m = _run(src, out)
    assert {n: (out / n).stat().st_ino for n in published} == published  # not rewritten
    assert m == _run(src, tmp_path / "fresh")
    assert tree_bytes(out) == tree_bytes(tmp_path / "fresh")


@pytest.mark.slow
def test_resume_after_kill_9(tmp_path):
    src = write_jsonl(tmp_path / "big.jsonl", make_docs(40000, seed=3, skew=True))
    out = tmp_path / "o"
    code = (
        "from nightloom.spec import DatasetSpec, ShardingSpec; from nightloom.sharding import shard_dataset; "
        f"shard_dataset(DatasetSpec(path={str(src)!r}), ShardingSpec(output={str(out)!r}, num_shards=16, tolerance=0.05))"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    work = out / ".nightloom-work"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if list(work.glob("*/shard-*.json")):  # killed while writing shards
                break
            time.sleep(0.005)
        killed = proc.poll() is None
        proc.send_signal(signal.SIGKILL) if killed else None
    finally:
        proc.wait(timeout=30)
    if not killed:
        pytest.skip("the run finished before it could be killed (machine too fast for this corpus)")
    assert not (out / "manifest.json").exists()
    # a shard counts as done once its marker is written (a shard renamed into place just before the kill,
    # without its marker yet, is legitimately rewritten on resume)
    markers = [json.loads(m.read_text())["path"] for m in work.glob("*/shard-*.json")]
    done_before = {n: (out / n).stat().st_ino for n in markers if (out / n).is_file()}
    assert done_before
    m = _run(src, out, num_shards=16)
    assert all((out / n).stat().st_ino == ino for n, ino in done_before.items())  # reused, not rewritten
    assert m == _run(src, tmp_path / "fresh", num_shards=16)
    assert tree_bytes(out) == tree_bytes(tmp_path / "fresh")


def test_same_documents_in_any_format_give_the_same_shards(tmp_path):
    from datasets import Dataset

    docs = make_docs(600, seed=9)
    srcs = {
        "jsonl": write_jsonl(tmp_path / "j" / "x.jsonl", docs),
        "zst": write_jsonl(tmp_path / "z" / "x.jsonl.zst", docs, compress="zst"),
        "parquet": write_parquet(tmp_path / "p" / "x.parquet", docs),
        "hf": tmp_path / "hf",
        "text": tmp_path / "t",
    }
    Dataset.from_dict({"text": docs}).save_to_disk(str(srcs["hf"]), max_shard_size="20KB")
    for i, d in enumerate(docs):
        (srcs["text"] / f"{i:04d}.txt").parent.mkdir(exist_ok=True)
        (srcs["text"] / f"{i:04d}.txt").write_text(d, encoding="utf-8")
    shas = {}
    for name, path in srcs.items():
        m = _run(path, tmp_path / f"out-{name}", num_shards=3, tolerance=0.1)
        shas[name] = [s.sha256 for s in m.shards]
    assert len(load_manifest(tmp_path / "out-hf").sources) > 1  # several Arrow files
    assert all(v == shas["jsonl"] for v in shas.values()), shas


def test_fast_path_and_record_path_agree(tmp_path):
    """key_field='text' forces the record-by-record reader; the Arrow fast path must give identical shards."""
    docs = make_docs(700, seed=12, dup_every=5) + ["", "   ", "\u2003\t", "\n" * 100, "\x1c", "x" * 70, " y "]
    d = tmp_path / "in"
    write_jsonl(d / "a.jsonl.gz", docs[:300], compress="gz")
    write_parquet(d / "b.parquet", docs[300:])
    fast = _run(d, tmp_path / "fast", num_shards=3)
    slow = _run(d, tmp_path / "slow", num_shards=3, key_field="text")
    assert fast.key == "<text>" and slow.key == "text"
    assert [s.sha256 for s in fast.shards] == [s.sha256 for s in slow.shards]
    assert (fast.empty_skipped, fast.dedup_dropped, fast.rows) == (slow.empty_skipped, slow.dedup_dropped, slow.rows)
    assert fast.empty_skipped == 5
