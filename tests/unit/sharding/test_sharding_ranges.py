"""A big JSONL file is scanned in line-aligned byte ranges (one unit each, so one file keeps every worker busy):
the output is byte-identical to scanning it whole, the file is accounted for once, and a bad line in a later
range is still named by its line number in the file."""

from __future__ import annotations

import json

import pytest

from nightloom.sharding import BadInputError, load_manifest, plan_job, shard_dataset
from nightloom.sharding import prepare as plan_module
from nightloom.spec import DatasetSpec, ShardingSpec
from tests.support.sharding import make_docs, tree_bytes


def _lines(bad_at: int | None = None) -> list[bytes]:
    docs = make_docs(400, seed=9, dup_every=6, skew=True)
    docs[37] = "x" * 9000  # longer than a range: the ranges it covers read nothing
    lines = [json.dumps({"text": d, "id": i}).encode() for i, d in enumerate(docs)]
    if bad_at is not None:
        lines[bad_at - 1] = b'{"text": "unterminated'
    return lines


def _write(tmp_path, lines) -> DatasetSpec:
    src = tmp_path / "big.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    return DatasetSpec(path=str(src))


def test_ranges_give_the_same_bytes_and_one_file_entry(tmp_path, monkeypatch):
    ds = _write(tmp_path, _lines())
    whole = ShardingSpec(output=str(tmp_path / "whole"), num_shards=3, tolerance=0.5, heldout=0.05)
    assert plan_job(ds, whole).ranges == [None]
    m_whole = shard_dataset(ds, whole, workers=1)

    monkeypatch.setattr(plan_module, "RANGE_BYTES", 4096)
    ranged = whole.model_copy(update={"output": str(tmp_path / "ranged")})
    job = plan_job(ds, ranged)
    size = job.sources[0].size
    assert len(job.units) == -(-size // 4096) > 10 and all(u == [0] for u in job.units)
    assert job.ranges[0] == (0, 4096) and job.ranges[-1][1] == size
    seen: list[tuple[str, int, int]] = []
    m_ranged = shard_dataset(ds, ranged, workers=2, progress=lambda *a: seen.append(a))
    scans = [(done, total) for stage, done, total in seen if stage == "scan"]
    assert len(scans) == len(job.units) and max(scans) == (1, 1)  # one file, counted once, at its last range

    assert tree_bytes(tmp_path / "whole") == tree_bytes(tmp_path / "ranged")
    assert m_whole.model_dump() == m_ranged.model_dump() == load_manifest(tmp_path / "ranged").model_dump()
    assert m_ranged.files_read == 1 and len(m_ranged.sources) == 1 and m_ranged.dedup_dropped > 0
    assert m_ranged.sources[0].documents == m_ranged.rows + m_ranged.heldout.rows


def test_bad_line_in_a_later_range_is_named_by_its_line_in_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_module, "RANGE_BYTES", 4096)
    ds = _write(tmp_path, _lines(bad_at=301))
    assert len(plan_job(ds, ShardingSpec(output=str(tmp_path / "o"), num_shards=2)).units) > 10
    with pytest.raises(BadInputError, match=r"big.jsonl:301: invalid JSON"):
        shard_dataset(ds, ShardingSpec(output=str(tmp_path / "fail"), num_shards=2, tolerance=0.5))
    m = shard_dataset(
        ds, ShardingSpec(output=str(tmp_path / "skip"), num_shards=2, tolerance=0.5, on_error="skip"), workers=2
    )
    assert m.bad_records == 1 and (m.bad_examples[0].file, m.bad_examples[0].line) == ("big.jsonl", 301)
    assert m.files_read == 1 and m.files_bad == 0


def test_no_ranges_when_the_record_path_reads_the_file(tmp_path, monkeypatch):
    """A kept column or a key field takes the record path, which numbers lines from the file's start: whole file."""
    monkeypatch.setattr(plan_module, "RANGE_BYTES", 4096)
    ds = _write(tmp_path, _lines())
    out = str(tmp_path / "o")
    assert len(plan_job(ds, ShardingSpec(output=out, num_shards=2)).units) > 10
    kept = ds.model_copy(update={"keep_columns": ["id"]})
    assert plan_job(kept, ShardingSpec(output=out, num_shards=2)).ranges == [None]
    assert plan_job(ds, ShardingSpec(output=out, num_shards=2, key_field="id")).ranges == [None]
