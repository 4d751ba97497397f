"""XTuner's base model through model.weights: which field names it, what it must hold, and the per-node cache
(content key, hash check against the source, stamp last, reuse). S3 is replaced by a local folder here, so a
download can be corrupted on purpose; tests/services/test_model_cache.py and test_xtuner_remote.py fetch from
SeaweedFS."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from nightloom.finetune import base_model as bm
from nightloom.finetune.config import XTunerConfigError
from nightloom.model_cache import STAMP, content_key
from nightloom.spec import RunSpec
from nightloom.storage import S3Object


def _model(folder: Path, tokenizer: bool = True, weights: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def _spec(tmp: Path, weights: str | None = None, alias: str = "", tokenizer=None) -> RunSpec:
    data = {
        "name": "t",
        "dataset": {"path": str(tmp / "d")},
        "sharding": {"output": str(tmp / "s")},
        "model": {"weights": weights, **({"tokenizer": tokenizer} if tokenizer is not None else {})},
        "train": {"backend": "xtuner", "xtuner": {"method": "lora", "base_model": alias}},
        "storage": {"root": str(tmp / "runs")},
    }
    return RunSpec.model_validate(data)


def test_model_weights_names_the_base_model_and_the_alias_still_works(tmp_path):
    m = str(_model(tmp_path / "m"))
    assert bm.base_source(_spec(tmp_path, weights=m)) == bm.BaseSource(m, "model.weights")
    assert bm.base_source(_spec(tmp_path, alias=m)) == bm.BaseSource(m, "train.xtuner.base_model")
    assert bm.base_source(_spec(tmp_path, weights=m, alias=m + "/")).field == "model.weights"  # same model
    assert bm.base_source(_spec(tmp_path, weights="s3://b/m")).is_s3


def test_both_fields_naming_different_models_is_an_error_naming_both(tmp_path):
    with pytest.raises(ValidationError, match=r"model\.weights \('/a'\) and train\.xtuner\.base_model \('/b'\)"):
        _spec(tmp_path, weights="/a", alias="/b")
    spec = _spec(tmp_path, weights="/a")
    spec.train.xtuner.base_model = "/b"  # set after validation (as resolved() does): base_source still refuses
    with pytest.raises(XTunerConfigError, match=r"model\.weights .* train\.xtuner\.base_model"):
        bm.base_source(spec)


def test_no_base_model_at_all_names_model_weights(tmp_path):
    with pytest.raises(XTunerConfigError, match=r"model\.weights: required for train\.backend 'xtuner'"):
        bm.base_source(_spec(tmp_path))


def test_a_bad_local_model_is_named_by_the_field_that_gave_it(tmp_path):
    bad = str(_model(tmp_path / "m", tokenizer=False))
    with pytest.raises(XTunerConfigError, match=r"model\.weights: .*missing a tokenizer"):
        bm.check_source(bm.base_source(_spec(tmp_path, weights=bad)))
    with pytest.raises(XTunerConfigError, match=r"train\.xtuner\.base_model: .*missing a tokenizer"):
        bm.check_source(bm.base_source(_spec(tmp_path, alias=bad)))
    with pytest.raises(XTunerConfigError, match=r"model\.weights: not a folder"):
        bm.check_source(bm.base_source(_spec(tmp_path, weights=str(tmp_path / "nope"))))


def test_a_separate_tokenizer_must_be_a_hugging_face_folder(tmp_path):
    m = str(_model(tmp_path / "m"))
    tok = _model(tmp_path / "tok", weights=False)
    src = bm.base_source(_spec(tmp_path, weights=m, tokenizer=str(tok)))
    assert src.tokenizer == str(tok)
    bm.check_source(src)
    assert bm.base_source(_spec(tmp_path, weights=m, tokenizer=m)).tokenizer is None  # the model's own
    with pytest.raises(XTunerConfigError, match=r"model\.tokenizer\.path: .*not a Hugging Face tokenizer folder"):
        bm.check_source(bm.base_source(_spec(tmp_path, weights=m, tokenizer=str(tmp_path))))
    with pytest.raises(XTunerConfigError, match=r"model\.tokenizer: XTuner loads a Hugging Face tokenizer"):
        bm.base_source(_spec(tmp_path, weights=m, tokenizer={"kind": "tiktoken", "path": str(tok)}))


def test_s3_listing_must_hold_config_tokenizer_and_weights():
    with pytest.raises(XTunerConfigError, match=r"model\.weights: s3://b/m: no objects"):
        bm._check_names("model.weights", "s3://b/m", [])
    with pytest.raises(XTunerConfigError, match=r"missing config\.json, weights"):
        bm._check_names("model.weights", "s3://b/m", ["tokenizer.json", "sub/model.safetensors"])
    bm._check_names("model.weights", "s3://b/m", ["config.json", "tokenizer.json", "model-00001.safetensors"])


def test_content_key_follows_every_name_size_and_etag():
    a = [S3Object("config.json", 10, "e1"), S3Object("model.safetensors", 64, "e2")]
    assert content_key(a) == content_key(list(a))
    assert content_key(a) != content_key([a[0], S3Object("model.safetensors", 64, "e3")])
    assert content_key(a) != content_key([a[0], S3Object("model.safetensors", 65, "e2")])
    assert content_key(a) != content_key(a[:1])


class FakeS3:
    """`storage.list_objects` and `storage.get_file` over a local folder standing for the prefix (ETag = MD5),
    so a download can be corrupted on purpose; tests/services/test_model_cache.py runs the real S3 server."""

    def __init__(self, src: Path, monkeypatch, corrupt: str | None = None):
        self.src, self.gets, self.corrupt = src, 0, corrupt
        from nightloom import storage

        monkeypatch.setattr(storage, "list_objects", self.listing)
        monkeypatch.setattr(storage, "get_file", self.get)

    def listing(self, uri, s3=None, markers=False):
        from nightloom.storage import S3Object

        return sorted(
            (S3Object(p.name, p.stat().st_size, hashlib.md5(p.read_bytes()).hexdigest()) for p in self.src.iterdir()),
            key=lambda o: o.name,
        )

    def get(self, uri, local: Path, s3=None):
        self.gets += 1
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.src / uri.rsplit("/", 1)[1], local)
        if self.corrupt and local.name == self.corrupt:
            local.write_bytes(b"\1" * local.stat().st_size)  # same size, other bytes
        return local


def test_fetch_is_once_per_cache_hash_checked_stamped_last_and_reused(tmp_path, monkeypatch):
    src = _model(tmp_path / "src")
    fake = FakeS3(src, monkeypatch)
    first = bm.fetch_cached("s3://b/m", tmp_path / "cache", log=lambda s: None)
    assert first.created and Path(first.path).name == first.key and fake.gets == 3
    stamp = json.loads((Path(first.path) / STAMP).read_text())
    assert stamp["files"] == 3 and stamp["key"] == first.key
    again = bm.fetch_cached("s3://b/m", tmp_path / "cache")
    assert not again.created and again.path == first.path and fake.gets == 3  # reused, nothing downloaded
    (src / "model.safetensors").write_bytes(b"\2" * 64)  # the model changed at the source: a new folder
    changed = bm.fetch_cached("s3://b/m", tmp_path / "cache", log=lambda s: None)
    assert changed.created and changed.key != first.key


def test_concurrent_fetches_download_once(tmp_path, monkeypatch):
    fake = FakeS3(_model(tmp_path / "src"), monkeypatch)
    out = []
    ts = [
        threading.Thread(target=lambda: out.append(bm.fetch_cached("s3://b/m", tmp_path / "c", log=print)))
        for _ in range(3)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(x.created for x in out) == [False, False, True] and fake.gets == 3


def test_a_file_that_differs_from_its_source_is_an_error_and_never_stamped(tmp_path, monkeypatch):
    FakeS3(_model(tmp_path / "src"), monkeypatch, corrupt="model.safetensors")
    with pytest.raises(XTunerConfigError, match=r"model\.safetensors: fetched file's MD5 differs"):
        bm.fetch_cached("s3://b/m", tmp_path / "cache")
    assert not list((tmp_path / "cache").glob(f"*/{STAMP}"))
    monkeypatch.undo()
    FakeS3(tmp_path / "src", monkeypatch)  # a later healthy fetch replaces the leftovers
    assert bm.fetch_cached("s3://b/m", tmp_path / "cache", log=lambda s: None).created
