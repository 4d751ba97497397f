"""model.tokenizer in the spec: the old dataset.tokenizer says where it moved; a vocabulary that does not cover
the tokenizer is an error naming both sizes; the tokenizer enters the sharding settings hash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nightloom.spec import SpecError, TokenizerSpec
from nightloom.spec.load import load_spec


def _bpe(folder: Path, corpus: Path, vocab: int = 300) -> Path:
    from nightloom.spec import DatasetSpec
    from nightloom.tokenizer import ensure_trained

    ensure_trained(TokenizerSpec(path=str(folder), train_vocab=vocab), DatasetSpec(path=str(corpus)))
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    p = tmp_path / "corpus.jsonl"
    words = "the night loom weaves long threads of data into models 数据 模型 🌙".split()
    p.write_text("".join(json.dumps({"text": " ".join(words[i:] + words[:i]) * 5}) + "\n" for i in range(12)))
    return p


def _write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def _errors(path: Path) -> list[str]:
    with pytest.raises(SpecError) as ei:
        load_spec(path)
    return ei.value.errors


def test_old_dataset_tokenizer_says_where_it_moved(tmp_path, corpus):
    p = _write(tmp_path, {"name": "t", "dataset": {"path": str(corpus), "tokenizer": "bytes"}})
    errs = _errors(p)
    assert errs == [f"{p}:4: dataset.tokenizer: moved to model.tokenizer (set it there)"]


def test_vocab_not_covering_the_tokenizer_names_both_numbers(tmp_path, corpus):
    tok = _bpe(tmp_path / "tok", corpus)
    p = _write(
        tmp_path, {"name": "t", "model": {"name": "tiny", "tokenizer": str(tok)}, "dataset": {"path": str(corpus)}}
    )
    (err,) = _errors(p)
    assert err.startswith(f"{p}:4: model.tokenizer: model tiny has 256 embedding rows but tokenizer ")
    from nightloom.tokenizer import load_tokenizer

    assert f"has {load_tokenizer(str(tok)).vocab_size} ids" in err
    p = _write(
        tmp_path, {"name": "t", "model": {"tokenizer": str(tok), "vocab": 260}, "dataset": {"path": str(corpus)}}
    )
    assert "model.vocab has 260 embedding rows" in _errors(p)[0]
    ok = {"name": "t", "model": {"tokenizer": str(tok), "vocab": "tokenizer"}, "dataset": {"path": str(corpus)}}
    spec = load_spec(_write(tmp_path, ok))
    assert spec.model.tokenizer.path == str(tok) and spec.model.tokenizer.kind == "auto"


def test_tokenizer_path_relative_to_the_spec_and_missing(tmp_path, corpus):
    data = {"name": "t", "model": {"tokenizer": "no-such-tok"}, "dataset": {"path": str(corpus)}}
    (err,) = _errors(_write(tmp_path, data))
    assert "model.tokenizer: not found: " + str(tmp_path / "no-such-tok") in err
    _bpe(tmp_path / "tok", corpus)
    data["model"] = {"tokenizer": "tok", "vocab": "tokenizer"}
    assert load_spec(_write(tmp_path, data)).model.tokenizer.path == str(tmp_path / "tok")


def test_bytes_is_the_default_and_shorthand():
    assert TokenizerSpec.coerce(None).is_bytes and TokenizerSpec.coerce("bytes").is_bytes
    assert TokenizerSpec.coerce("x.model").path == "x.model"


def test_tokenizer_and_heldout_change_the_settings_hash(tmp_path, corpus):
    from nightloom.sharding.prepare import plan_job
    from nightloom.spec import DatasetSpec, ShardingSpec

    ds, sh = DatasetSpec(path=str(corpus)), ShardingSpec(output=str(tmp_path / "out"), num_shards=2)
    base = plan_job(ds, sh)
    assert base.tokenizer_id == "bytes"
    assert plan_job(ds, sh, tokenizer="bytes").settings_hash == base.settings_hash
    a = plan_job(ds, sh, tokenizer=str(_bpe(tmp_path / "a", corpus, 300)))
    b = plan_job(ds, sh, tokenizer=str(_bpe(tmp_path / "b", corpus, 280)))
    c = plan_job(ds, sh, tokenizer=str(tmp_path / "a"))
    assert len({base.settings_hash, a.settings_hash, b.settings_hash}) == 3
    assert c.settings_hash == a.settings_hash
    held = plan_job(ds, sh.model_copy(update={"heldout": 2}))
    assert held.settings_hash != base.settings_hash


def test_heldout_count_and_fraction(tmp_path, corpus):
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec

    ds = DatasetSpec(path=str(corpus))
    two = shard_dataset(ds, ShardingSpec(output=str(tmp_path / "n"), num_shards=2, tolerance=0.9, heldout=2))
    assert two.heldout.rows == 2 and two.rows == 10
    again = shard_dataset(ds, ShardingSpec(output=str(tmp_path / "n2"), num_shards=2, tolerance=0.9, heldout=2))
    assert again.heldout.sha256 == two.heldout.sha256  # deterministic
    none = shard_dataset(ds, ShardingSpec(output=str(tmp_path / "z"), num_shards=2, tolerance=0.9))
    assert none.heldout is None and none.rows == 12
    with pytest.raises(ValueError, match="whole count"):
        ShardingSpec(heldout=2.5)


def test_eval_needs_a_heldout_split_or_eval_data(tmp_path, corpus):
    data = {"name": "t", "dataset": {"path": str(corpus)}, "validate": {"eval_every": 5}}
    (err,) = _errors(_write(tmp_path, data))
    assert err.endswith(":5: validate.eval_every: needs a held-out split (sharding.heldout) or validate.eval_data")
    data["validate"]["eval_data"] = "missing.jsonl"
    (err,) = _errors(_write(tmp_path, data))
    assert "validate.eval_data: file not found: " + str(tmp_path / "missing.jsonl") in err
    data["validate"]["eval_data"] = str(corpus)
    assert load_spec(_write(tmp_path, data)).validate_.eval_data == str(corpus)
    data["validate"].pop("eval_data")
    data["sharding"] = {"heldout": 0.1}
    assert load_spec(_write(tmp_path, data)).sharding.heldout == 0.1


def test_eval_windows_from_eval_data_and_heldout(tmp_path, corpus):
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec
    from nightloom.tokenizer import load_tokenizer
    from nightloom.train.data import DataError, eval_windows, read_eval_texts

    out = tmp_path / "shards"
    shard_dataset(DatasetSpec(path=str(corpus)), ShardingSpec(output=str(out), num_shards=2, tolerance=0.9))
    with pytest.raises(DataError, match="needs a held-out split"):
        read_eval_texts(str(out), None)
    where, texts = read_eval_texts(str(out), str(corpus))
    assert where == str(corpus) and len(texts) == 12
    tok = load_tokenizer("bytes")
    w = eval_windows(texts, tok, 16, 5, where)
    stream = tok.stream(texts)
    assert w.shape == (5, 17) and w.flatten().tolist() == stream[: 5 * 17].tolist()
    with pytest.raises(DataError, match="do not fill one window"):
        eval_windows(["ab"], tok, 16, 5, "x")
