"""Every bad input named in issue 3 fails with file and line (or row), and leaves nothing half-written."""

from __future__ import annotations

import json

import pytest

from nightloom.sharding import BadInputError, ShardingError, shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec
from tests.support.sharding import make_docs, write_jsonl, write_parquet


def _run(path, out, **kw):
    kw.setdefault("num_shards", 2)
    kw.setdefault("tolerance", 0.5)
    text_field = kw.pop("text_field", "text")
    return shard_dataset(DatasetSpec(path=str(path), text_field=text_field), ShardingSpec(output=str(out), **kw))


def _good_lines(n=20):
    return [json.dumps({"text": d, "id": i}).encode() for i, d in enumerate(make_docs(n, seed=2))]


BAD_LINES = {
    "corrupt-json": (b'{"text": "unterminated', "invalid JSON"),
    "non-utf8": (b'{"text": "caf\xe9 au lait"}', "non-UTF-8 byte 0xe9 at byte offset 13"),
    "missing-text": (b'{"body": "no text here"}', "missing field 'text'"),
    "not-a-string": (b'{"text": 42}', "int in field 'text'"),
    "not-an-object": (b'["text"]', "expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_jsonl_record_names_file_and_line(tmp_path, case):
    bad, reason = BAD_LINES[case]
    lines = _good_lines()
    lines.insert(6, bad)  # line 7
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    with pytest.raises(BadInputError) as e:
        _run(src, out)
    assert f"{src}:7: " in str(e.value) and reason in str(e.value), str(e.value)
    assert not out.exists() or not [p for p in out.iterdir() if p.name != ".nightloom-work"]


def test_missing_key_field(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", make_docs(10))
    with pytest.raises(BadInputError, match=rf"{src}:1: missing key field 'url'"):
        _run(src, tmp_path / "out", key_field="url")


def test_missing_column_and_corrupt_parquet(tmp_path):
    good = write_parquet(tmp_path / "a" / "x.parquet", make_docs(10))
    with pytest.raises(BadInputError, match=r"x.parquet: missing field 'body' \(columns: text, id\)"):
        _run(good, tmp_path / "out", text_field="body")
    broken = tmp_path / "b" / "y.parquet"
    broken.parent.mkdir()
    broken.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(BadInputError, match=rf"{broken}: corrupt Parquet file"):
        _run(broken, tmp_path / "out2")


def test_null_text_in_parquet_names_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": ["one", "two", None, "four"]}), p)
    with pytest.raises(BadInputError, match=rf"{p}:3: null in field 'text'"):
        _run(p, tmp_path / "out")


def test_non_utf8_text_file(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    (d / "ok.txt").write_text("fine")
    (d / "bad.txt").write_bytes(b"ab\xffcd")
    with pytest.raises(BadInputError, match=rf"{d / 'bad.txt'}:1: non-UTF-8 byte 0xff at byte offset 2"):
        _run(d, tmp_path / "out")


def test_truncated_compressed_stream(tmp_path):
    src = write_jsonl(tmp_path / "x.jsonl.gz", make_docs(500), compress="gz")
    src.write_bytes(src.read_bytes()[:-200])
    with pytest.raises(BadInputError, match=rf"{src}: cannot read"):
        _run(src, tmp_path / "out")


def test_unknown_format_and_missing_path(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(BadInputError, match="unknown input format"):
        _run(tmp_path, tmp_path / "out")
    with pytest.raises(BadInputError, match="dataset path not found"):
        _run(tmp_path / "nope.jsonl", tmp_path / "out")


def test_on_error_skip_counts_and_lists_bad_records(tmp_path):
    lines = _good_lines(300)
    for pos, (bad, _) in zip((3, 50, 120), BAD_LINES.values()):
        lines.insert(pos, bad)
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    m = _run(src, tmp_path / "out", on_error="skip", max_bad_fraction=0.05)
    assert m.bad_records == 3 and m.rows == 300
    assert [(b.file, b.line) for b in m.bad_examples] == [("in.jsonl", 4), ("in.jsonl", 51), ("in.jsonl", 121)]
    with pytest.raises(BadInputError, match=r"3 of 303 records are bad .* first: in.jsonl:4: invalid JSON"):
        _run(src, tmp_path / "out2", on_error="skip", max_bad_fraction=0.005)
    assert not (tmp_path / "out2" / "manifest.json").exists()


def test_error_does_not_publish_partial_output(tmp_path):
    d = tmp_path / "in"
    write_jsonl(d / "a.jsonl", make_docs(50))
    (d / "b.jsonl").write_bytes(b'{"text": "ok"}\n{broken\n')
    out = tmp_path / "out"
    with pytest.raises(ShardingError, match=r"b.jsonl:2"):
        _run(d, out)
    assert not list(out.glob("shard-*")) and not (out / "manifest.json").exists()


def _texts(out):
    import pyarrow.parquet as pq

    return sorted(t for p in sorted(out.glob("shard-*.parquet")) for t in pq.read_table(p).column("text").to_pylist())


def test_nan_and_infinity_numbers_are_read_alike_on_the_fast_and_the_record_path(tmp_path):
    """Arrow's reader (the fast path) accepts NaN/Infinity, which Python's json.dumps writes; a file that falls back
    to the record path for an unrelated bad line must not lose those records as well."""
    lines = _good_lines(40)
    for pos, spelled in zip((2, 9, 30), ("NaN", "Infinity", "-Infinity")):
        lines.insert(pos, b'{"text": "score %d is %s", "score": %s}' % (pos, spelled.encode(), spelled.encode()))
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(b"\n".join(lines) + b"\n")
    fast = _run(clean, tmp_path / "fast", on_error="skip")
    assert (fast.rows, fast.bad_records) == (43, 0)

    bad = lines[:20] + [b'{"text": "unterminated'] + lines[20:]
    bad.insert(5, b'{"text": "lone \\ud800 surrogate", "score": NaN}')  # still bad: not valid UTF-8 text
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b"\n".join(bad) + b"\n")
    slow = _run(mixed, tmp_path / "slow", on_error="skip", max_bad_fraction=0.1)
    assert (slow.rows, slow.bad_records) == (43, 2)
    assert [b.line for b in slow.bad_examples] == [6, 22]
    assert _texts(tmp_path / "slow") == _texts(tmp_path / "fast")


def test_the_record_reader_and_json_lines_judge_each_line_alike(tmp_path):
    """read_jsonl (the record path) and json_lines (chats, pairs) share the line rules: blank lines are no record,
    NaN numbers read, bad JSON and bad UTF-8 name the line; a truncated gzip stream is a BadInputError in both."""
    import gzip

    from nightloom.sharding.sources import json_lines, read_jsonl

    lines = [b'{"text": "a"}', b"", b'{"text": "b", "x": NaN}', b"{oops", b'{"text": "\xff"}', b'{"text": "c"}']
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    records = [(n, text, why) for n, text, _, why, _ in read_jsonl(path, "text", None)]
    values = [(n, None if obj is None else obj["text"], why) for n, obj, why in json_lines(path)]
    assert [r[:2] for r in records] == [v[:2] for v in values] == [(1, "a"), (3, "b"), (4, None), (5, None), (6, "c")]
    assert [r[2] for r in records] == [v[2] for v in values]
    assert records[2][2].startswith("invalid JSON") and "UTF-8" in records[3][2]
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes())[:-12])
    for read in (lambda: list(read_jsonl(gz, "text", None)), lambda: list(json_lines(gz))):
        with pytest.raises(BadInputError, match="t.jsonl.gz: cannot read compressed"):
            read()
