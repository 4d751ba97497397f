"""The shard stage with sharding.filters and sharding.near_dup: the kept set is near_dup's on what the filters and
exact dedup leave, whatever the files, units or threads; counts in the manifest and summary; held-out split after
filtering; every file accounted for; the side file of removed documents; reuse and re-shard by settings."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from nightloom.sharding import shard_dataset
from nightloom.sharding.corpus import ensure_sample_corpus
from nightloom.sharding.filters import check, check_edit
from nightloom.sharding.near_dup import near_duplicates
from nightloom.sharding.planted import planted_corpus
from nightloom.sharding.summary import summarize
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from nightloom.spec.quality import FiltersSpec
from nightloom.tokenizer import load_tokenizer
from tests.support.sharding import small_bpe

SHORT = "lorem ipsum"  # under min_chars: removed by the length filter


@pytest.fixture(scope="module")
def texts():
    c = planted_corpus(250, seed=7)
    return c.texts + c.texts[:20]  # and exact copies


def _write(folder, parts: list[list[str]]):
    folder.mkdir(parents=True, exist_ok=True)
    for k, part in enumerate(parts):
        (folder / f"p{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    return folder


def _expected(texts: list[str], filters: FiltersSpec) -> set[str]:
    first, seen = [], set()
    for t in texts:  # exact dedup first, then the filters, then near-dup on what is left
        if t not in seen and check(t, filters) is None:
            first.append(t)
        seen.add(t)
    return {t for t, r in zip(first, near_duplicates(first), strict=True) if not r}


def _kept(out, m) -> set[str]:
    files = [s.path for s in m.shards] + ([m.heldout.path] if m.heldout else [])
    got = [t for f in files for t in pq.read_table(out / f).column("text").to_pylist()]
    assert len(got) == len(set(got))
    return set(got)


def _sharding(out, **kw) -> ShardingSpec:
    return ShardingSpec(
        output=str(out), num_shards=2, near_dup={}, filters={"length": {"min_chars": 40}, "samples": 3}, **kw
    )


def test_kept_set_counts_files_and_side_file(tmp_path, texts):
    src = _write(tmp_path / "in", [texts[0::3], texts[1::3], texts[2::3], [SHORT] * 4])
    out = tmp_path / "out"
    spec = _sharding(out, heldout=0.1)
    m = shard_dataset(DatasetSpec(path=str(src)), spec, workers=2)
    want = _expected(texts[0::3] + texts[1::3] + texts[2::3] + [SHORT] * 4, spec.filters)
    assert _kept(out, m) == want
    q = m.quality
    assert q.removed["length"].documents == 1 and q.removed["near_dup"].documents > 50  # 3 exact copies of SHORT
    assert m.rows + m.heldout.rows + m.dedup_dropped + sum(r.documents for r in q.removed.values()) == len(texts) + 4
    assert m.heldout.rows > 0 and len(want) == m.rows + m.heldout.rows  # held out from what the filters kept
    assert [s.status for s in m.sources] == ["read", "read", "read", "filtered"] and q.files_filtered == 1
    assert sum(s.documents for s in m.sources) == m.rows + m.heldout.rows
    samples = [orjson.loads(x) for x in (out / q.samples).read_bytes().splitlines()]
    assert samples == [{"filter": "length", "reason": "too_few_chars", "text": SHORT}]
    summary = summarize(m, str(out))
    assert "near_dup" in summary.quality_line() and summary.table()[-1]["verdict"].endswith(summary.quality_line())
    again = shard_dataset(DatasetSpec(path=str(src)), spec, workers=1)
    assert again == m  # the same settings: reused
    other = shard_dataset(
        DatasetSpec(path=str(src)),
        ShardingSpec.model_validate({**spec.model_dump(), "near_dup": {"bands": 16, "rows": 7, "num_perm": 112}}),
        workers=1,
    )
    assert other.settings_hash != m.settings_hash  # other thresholds: re-sharded


def test_same_kept_set_for_any_files_units_and_threads(tmp_path, texts):
    one = tmp_path / "one"
    a = shard_dataset(DatasetSpec(path=str(_write(tmp_path / "a", [texts]))), _sharding(one), workers=1)
    many = tmp_path / "many"
    parts = [texts[i::7] for i in range(7)][::-1]  # other files, other order
    b = shard_dataset(DatasetSpec(path=str(_write(tmp_path / "b", parts))), _sharding(many), workers=2)
    assert _kept(one, a) == _kept(many, b)
    assert a.quality.removed == b.quality.removed


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> TokenizerSpec:
    return small_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_c4_writes_the_edited_documents(tmp_path, request, which):
    """With C4 on, a kept document is stored as C4 leaves it (its kept lines: datatrove's output text, as
    test_filters_vs_datatrove checks), in input order, its token ids and counts those of the edited text."""
    sample = ensure_sample_corpus(Path(__file__).resolve().parents[3] / "datasets" / "sample" / "corpus.jsonl")
    texts = [orjson.loads(x)["text"] for x in sample.read_bytes().splitlines()[:1500]]
    src = _write(tmp_path / "in", [texts[:700], texts[700:]])
    tok = request.getfixturevalue("bpe") if which == "bpe" else TokenizerSpec.coerce("bytes")
    spec = ShardingSpec(output=str(tmp_path / "out"), num_shards=2, filters={"c4": True}, dedup=False)
    m = shard_dataset(DatasetSpec(path=str(src)), spec, workers=2, tokenizer=tok)
    want = [out for why, out in (check_edit(t, spec.filters) for t in texts) if why is None]
    place = {t: i for i, t in reversed(list(enumerate(want)))}
    got = [pq.read_table(tmp_path / "out" / s.path).column("text").to_pylist() for s in m.shards]
    assert sorted(t for g in got for t in g) == sorted(want) and 50 < len(want) < len(texts)
    assert all([place[t] for t in g] == sorted(place[t] for t in g) for g in got)  # input order
    assert sum(w not in texts for w in want) > len(want) // 10  # lines were removed from many
    assert m.quality.removed["c4"].documents == len(texts) - len(want)
    lengths = load_tokenizer(tok).encode_ids(want)[0] if which == "bpe" else [len(w.encode()) for w in want]
    assert sum(s.token_files.tokens for s in m.shards) == int(sum(lengths)) + len(want)  # with EOS each
