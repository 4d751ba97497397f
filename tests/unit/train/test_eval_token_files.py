"""Held-out evaluation reads the shard stage's token file: the same windows as tokenizing the held-out text (the
path kept for `validate.eval_data` and manifests without token files), and nothing is tokenized on the way."""

from __future__ import annotations

import json

import pytest
import torch

from nightloom.sharding import load_manifest, shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from nightloom.tokenizer import Tokenizer, load_tokenizer
from nightloom.train.data import eval_windows, read_eval_texts, read_eval_windows
from tests.support.sharding import make_docs, write_jsonl


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    return write_jsonl(root / "a.jsonl", make_docs(300, seed=5) + ["数据 模型 🌙 naïve"])


def _bpe(folder, corpus) -> TokenizerSpec:
    from nightloom.tokenizer import ensure_trained

    spec = TokenizerSpec(path=str(folder), train_vocab=300)
    ensure_trained(spec, DatasetSpec(path=str(corpus)))
    return TokenizerSpec(path=str(folder))


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_heldout_windows_from_token_file_equal_the_text_path(tmp_path, corpus, which, monkeypatch):
    spec = _bpe(tmp_path / "tok", corpus) if which == "bpe" else TokenizerSpec.coerce("bytes")
    out = tmp_path / "out"
    sharding = ShardingSpec(output=str(out), num_shards=2, tolerance=0.9, heldout=0.2)
    shard_dataset(DatasetSpec(path=str(corpus)), sharding, tokenizer=spec)
    m = load_manifest(out)
    assert m.heldout is not None and m.heldout.token_files is not None
    tok = load_tokenizer(spec)
    _, texts = read_eval_texts(str(out), None)
    want = eval_windows(texts, tok, 15, 6, "text")
    assert want.shape == (6, 16)

    def no_tokenizing(*a, **k):
        raise AssertionError("the held-out split was tokenized at load")

    monkeypatch.setattr(Tokenizer, "stream", no_tokenizing)
    monkeypatch.setattr(type(tok), "stream", no_tokenizing)
    where, got = read_eval_windows(str(out), None, tok, 15, 6)
    assert where.endswith(m.heldout.token_files.bin)
    assert torch.equal(got, want)
    # asking for more windows than the split holds gives all of them, as the text path does
    monkeypatch.undo()
    everything = eval_windows(texts, tok, 15, 10**6, "text")
    assert torch.equal(read_eval_windows(str(out), None, tok, 15, 10**6)[1], everything)


def test_manifest_without_heldout_token_files_falls_back_to_the_text(tmp_path, corpus):
    out = tmp_path / "out"
    shard_dataset(
        DatasetSpec(path=str(corpus)), ShardingSpec(output=str(out), num_shards=2, tolerance=0.9, heldout=0.2)
    )
    doc = json.loads((out / "manifest.json").read_text())
    doc["heldout"]["token_files"] = None  # as a manifest written before schema 3 lists it
    (out / "manifest.json").write_text(json.dumps(doc))
    tok = load_tokenizer("bytes")
    _, texts = read_eval_texts(str(out), None)
    where, got = read_eval_windows(str(out), None, tok, 15, 4)
    assert where.endswith(".parquet") and torch.equal(got, eval_windows(texts, tok, 15, 4, where))
