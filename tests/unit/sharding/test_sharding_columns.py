"""`dataset.keep_columns`: extra fields copied into every shard row, as strings; hashing stays on key/text."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nightloom.sharding import BadInputError, load_manifest, shard_dataset
from nightloom.sharding.manifest import ShardManifest
from nightloom.spec import DatasetSpec, ShardingSpec
from tests.support.sharding import shard_texts


def _rows(n: int) -> list[dict]:
    """Alpaca-style rows plus an OpenAI-style `messages` list and a number: non-string values to encode."""
    return [
        {
            "instruction": f"Say {i} twice.",
            "input": "" if i % 3 else f"context {i} λ",
            "output": f"{i} {i} " + "x" * (i % 7),
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
            "score": i * 0.5,
        }
        for i in range(n)
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _shard(path: Path, out: Path, keep: list[str], **sharding) -> ShardManifest:
    ds = DatasetSpec(path=str(path), text_field="output", keep_columns=keep)
    sh = ShardingSpec(num_shards=3, output=str(out), balance_by="rows", tolerance=0.9, **sharding)
    return shard_dataset(ds, sh)


def _table(out: Path) -> list[dict]:
    m = load_manifest(out)
    return [r for s in m.shards for r in pq.read_table(out / s.path).to_pylist()]


KEEP = ["instruction", "input", "messages", "score"]


def test_columns_carried_from_jsonl_and_parquet_alike(tmp_path):
    rows = _rows(40)
    src_j = _write_jsonl(tmp_path / "a.jsonl", rows)
    src_p = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src_p, row_group_size=16)

    mj = _shard(src_j, tmp_path / "outj", KEEP)
    mp = _shard(src_p, tmp_path / "outp", KEEP)

    got = _table(tmp_path / "outj")
    assert len(got) == 40 and mj.rows == 40
    assert all(list(r) == ["output", *KEEP] for r in got)  # text column first, then kept ones in spec order
    by_output = {r["output"]: r for r in rows}
    for r in got:
        src = by_output[r["output"]]
        assert r["instruction"] == src["instruction"] and r["input"] == src["input"]  # strings verbatim
        assert json.loads(r["messages"]) == src["messages"]  # list of dicts → JSON
        assert json.loads(r["score"]) == src["score"]
    schema = pq.read_schema(tmp_path / "outj" / mj.shards[0].path)
    assert all(schema.field(c).type == pa.string() for c in KEEP)
    assert mj.keep_columns == KEEP

    # Same shards whichever the input format: same placement, same rows, same column values.
    assert [s.rows for s in mp.shards] == [s.rows for s in mj.shards]
    assert [[(s.rows, s.tokens, s.bytes)] for s in mp.shards] == [[(s.rows, s.tokens, s.bytes)] for s in mj.shards]
    assert _table(tmp_path / "outp") == got


def test_hashing_and_counts_ignore_kept_columns(tmp_path):
    """Placement, dedup, tokens and bytes depend on key/text only: kept columns change nothing but the rows."""
    rows = _rows(40)
    src = _write_jsonl(tmp_path / "a.jsonl", rows)
    plain = _shard(src, tmp_path / "plain", [])
    kept = _shard(src, tmp_path / "kept", ["instruction", "messages"])
    assert shard_texts(tmp_path / "plain") == shard_texts(tmp_path / "kept")
    assert [(s.rows, s.tokens, s.bytes) for s in plain.shards] == [(s.rows, s.tokens, s.bytes) for s in kept.shards]
    assert plain.keep_columns == [] and plain.settings_hash != kept.settings_hash


def test_missing_column_names_file_and_line(tmp_path):
    rows = _rows(10)
    del rows[6]["input"]
    src = _write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(BadInputError, match=r"a\.jsonl:7: missing field 'input' \(dataset\.keep_columns\)"):
        _shard(src, tmp_path / "out", ["instruction", "input"])
    assert not (tmp_path / "out" / "manifest.json").exists()

    m = _shard(src, tmp_path / "skip", ["instruction", "input"], on_error="skip", max_bad_fraction=0.2)
    assert m.rows == 9 and m.bad_records == 1
    assert (m.bad_examples[0].file, m.bad_examples[0].line) == ("a.jsonl", 7)
    assert "input" in m.bad_examples[0].reason


def test_missing_parquet_column_names_file(tmp_path):
    src = tmp_path / "a.parquet"
    pq.write_table(pa.table({"output": ["a", "b"], "instruction": ["x", "y"]}), src)
    with pytest.raises(BadInputError, match=r"a\.parquet: missing field 'input'"):
        _shard(src, tmp_path / "out", ["instruction", "input"])


def test_null_values_stay_null(tmp_path):
    rows = [{"output": f"o{i}", "input": None if i % 2 else f"i{i}"} for i in range(6)]
    _shard(_write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "out", ["input"])
    assert sorted((r["output"], r["input"]) for r in _table(tmp_path / "out")) == [
        (r["output"], r["input"]) for r in rows
    ]


def test_other_keep_columns_are_not_reused(tmp_path):
    src = _write_jsonl(tmp_path / "a.jsonl", _rows(20))
    out = tmp_path / "out"
    first = _shard(src, out, ["instruction"])
    again = _shard(src, out, ["instruction"])
    assert again.settings_hash == first.settings_hash  # same settings: reused
    second = _shard(src, out, ["instruction", "input"])
    assert second.settings_hash != first.settings_hash
    assert all(set(r) == {"output", "instruction", "input"} for r in _table(out))
    assert load_manifest(out).keep_columns == ["instruction", "input"]
    assert sorted(p.name for p in out.glob("shard-*.parquet")) == sorted(s.path for s in second.shards)


def test_keep_columns_overlapping_text_or_key_are_stored_once(tmp_path):
    src = _write_jsonl(tmp_path / "a.jsonl", [{"output": f"o{i}", "instruction": f"i{i}", "id": i} for i in range(8)])
    m = _shard(src, tmp_path / "out", ["output", "id", "instruction", "instruction"], key_field="id")
    rows = _table(tmp_path / "out")
    assert all(list(r) == ["output", "id", "instruction"] for r in rows)
    assert sorted(r["id"] for r in rows) == sorted(str(i) for i in range(8)) and m.rows == 8


def test_text_folder_refuses_keep_columns(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("hello")
    with pytest.raises(BadInputError, match=r"dataset\.keep_columns: .*a\.txt is a plain text file"):
        shard_dataset(
            DatasetSpec(path=str(folder), keep_columns=["title"]),
            ShardingSpec(num_shards=1, output=str(tmp_path / "out")),
        )


def test_old_manifest_without_keep_columns_still_loads(tmp_path):
    src = _write_jsonl(tmp_path / "a.jsonl", _rows(6))
    m = _shard(src, tmp_path / "out", [])
    doc = json.loads(m.to_json())
    del doc["keep_columns"]
    assert ShardManifest.model_validate(doc).keep_columns == []
