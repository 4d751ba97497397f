"""sharding.near_dup and sharding.filters: off by default and out of the spec hash and the settings hash while
off; on, in both; bad parameters refused at validate as FILE:LINE: field.path: reason."""

from __future__ import annotations

import pytest
import yaml

from nightloom.sharding.prepare import settings_hash
from nightloom.spec import DatasetSpec, RunSpec, ShardingSpec, SpecError, schema
from nightloom.spec.load import load_spec
from nightloom.spec.quality import FiltersSpec, NearDupSpec


def _write(tmp_path, sharding: dict):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    data = {"name": "q", "dataset": {"path": str(corpus)}, "sharding": {"num_shards": 2, **sharding}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data, path


def test_off_by_default_and_hash_neutral(tmp_path, monkeypatch):
    data, path = _write(tmp_path, {})
    assert load_spec(path).sharding.near_dup is None and load_spec(path).sharding.filters is None
    plain = RunSpec.model_validate(data)
    on = RunSpec.model_validate({**data, "sharding": {**data["sharding"], "near_dup": {}}})
    assert on.sharding.near_dup == NearDupSpec()
    before = plain.spec_hash()
    assert before != on.spec_hash()
    for key in (("sharding", "near_dup"), ("sharding", "filters")):
        monkeypatch.delitem(schema.HASH_NEUTRAL_DEFAULTS, key)
    assert plain.spec_hash() != before  # the hash left both fields out while off: earlier specs keep theirs
    ds = DatasetSpec(path=str(tmp_path / "c.jsonl"))
    base = settings_hash(ds, ShardingSpec(num_shards=2), [])
    assert "near_dup" not in ShardingSpec().model_dump(exclude_none=True)
    hashes = {
        settings_hash(ds, ShardingSpec(num_shards=2, **extra), [])
        for extra in ({"near_dup": {}}, {"near_dup": {"bands": 16, "rows": 7}}, {"filters": {"c4": True}})
    }
    assert base not in hashes and len(hashes) == 3  # other thresholds re-shard
    assert settings_hash(ds, ShardingSpec(num_shards=2, near_dup={}), []) in hashes  # the same settings reuse


def test_true_turns_a_filter_on_with_published_thresholds():
    f = FiltersSpec.model_validate({"gopher_quality": True, "fineweb": {"line_punct_thr": 0.2}, "c4": False})
    assert f.enabled() == ["gopher_quality", "fineweb"]
    assert f.gopher_quality.min_doc_words == 50 and f.fineweb.line_punct_thr == 0.2
    assert NearDupSpec().threshold == pytest.approx((1 / 14) ** (1 / 8))


@pytest.mark.parametrize(
    ("sharding", "where", "words"),
    [
        ({"near_dup": {"bands": 10}}, "sharding.near_dup", "bands × rows must equal num_perm: 10 × 8 = 80"),
        ({"near_dup": {"ngram": 0}}, "sharding.near_dup.ngram", "greater than or equal to 1"),
        ({"filters": {}}, "sharding.filters", "no filter is on"),
        (
            {"filters": {"gopher_quality": {"min_alpha_words_ratio": 1.5}}},
            "gopher_quality.min_alpha_words_ratio",
            "[0, 1]",
        ),
        ({"filters": {"gopher_repetition": {"top_n_grams": [[0, 0.2]]}}}, "top_n_grams", "n >= 1"),
        ({"filters": {"length": {"min_chars": 10, "max_chars": 5}}}, "sharding.filters.length", "below min_chars"),
        ({"filters": {"c4": {"min_sentences": 3}}}, "sharding.filters.c4.min_sentences", "unknown key"),
    ],
)
def test_bad_parameters_refused_with_their_field_path(tmp_path, sharding, where, words):
    _, path = _write(tmp_path, sharding)
    with pytest.raises(SpecError) as e:
        load_spec(path)
    line = next(x for x in e.value.errors if where in x)
    assert line.startswith(f"{path}:") and words in line, e.value.errors
