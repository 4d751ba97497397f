"""One model cache for both backends, against a real S3 server (SeaweedFS): an s3:// Hugging Face model named
by `model.weights` is fetched once per machine whichever backend asks, checked against its objects, and a
changed object gives a new folder (never a stale or half-written one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nightloom import storage as st
from nightloom.finetune import base_model as bm
from nightloom.hf.config import shape_from_hf_config
from nightloom.hf.load import WeightsError, fetch_weights, scan_checkpoint
from nightloom.hf.random_model import build_random_model
from nightloom.model_cache import STAMP

SMALL = {
    "vocab_size": 301,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def _upload(folder: Path, uri: str, s3: st.S3Config) -> None:
    for f in sorted(folder.iterdir()):
        st.put_file(f, st.join(uri, f.name), s3)


def test_native_and_xtuner_share_one_verified_copy_and_a_changed_object_gets_a_new_one(s3_endpoint, tmp_path):
    endpoint, bucket = s3_endpoint
    s3 = st.S3Config(endpoint_url=endpoint)
    model = build_random_model(tmp_path / "src", "llama", seed=0, max_shard_size="60KB", **SMALL)
    (model / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    uri = f"s3://{bucket}/models/cache-{tmp_path.name}"
    _upload(model, uri, s3)
    cache, logs = tmp_path / "cache", []

    native = fetch_weights(uri, s3, cache_root=cache, log=logs.append)
    assert native.parent == cache and (native / STAMP).is_file() and len(logs) == 1
    shape = shape_from_hf_config(native / "config.json")
    assert scan_checkpoint(native, shape).total_bytes > 0  # every tensor there, every shape right
    for f in model.iterdir():  # byte for byte the uploaded files
        assert (native / f.name).read_bytes() == f.read_bytes(), f.name

    xt = bm.fetch_cached(uri, cache, s3, log=logs.append)
    assert Path(xt.path) == native and not xt.created and len(logs) == 1  # the same folder, nothing downloaded

    # the model changes at the source: a new content key, a new folder; the old one is untouched
    first = next(model.glob("*.safetensors"))
    st.put_file(model / "config.json", st.join(uri, "config.json.bak"), s3)
    changed = fetch_weights(uri, s3, cache_root=cache, log=logs.append)
    assert changed != native and (changed / "config.json.bak").is_file() and (native / first.name).is_file()

    # a prefix without weights: refused from the listing, nothing downloaded
    bare = f"s3://{bucket}/models/bare-{tmp_path.name}"
    st.put_file(model / "config.json", st.join(bare, "config.json"), s3)
    with pytest.raises(WeightsError, match=r"model\.weights: s3://.*/bare-.*: no \*\.safetensors objects"):
        fetch_weights(bare, s3, cache_root=cache)
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == sorted([native.name, changed.name])
