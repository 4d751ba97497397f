"""The storage config travels explicitly (no module global): what it holds, where the work folder goes, and
how a named secret becomes keys without ever entering the config, a message or a log."""

from __future__ import annotations

import pickle

import pytest

from nightloom import storage as st
from nightloom.sharding.prepare import WORK_DIR_NAME, WORK_FORMAT, default_workdir, plan_job
from nightloom.sharding.workdir import WorkDir
from nightloom.spec import DaskSpec, DatasetSpec, ShardingSpec, StorageSpec
from nightloom.storage import StorageError
from tests.support.sharding import make_docs, write_jsonl


def test_config_from_spec_has_no_secret_and_travels_in_the_job(tmp_path):
    spec = StorageSpec(s3_endpoint_url=" http://127.0.0.1:9 ", s3_region="eu-west-1", credentials_secret="s3-keys")
    cfg = st.S3Config.from_spec(spec)
    assert cfg == st.S3Config(endpoint_url="http://127.0.0.1:9", region="eu-west-1", credentials_secret="s3-keys")
    assert st.S3Config.from_spec(None) == st.S3Config()
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(40))
    job = plan_job(DatasetSpec(path=str(src)), ShardingSpec(output=str(tmp_path / "o"), num_shards=2), spec)
    assert job.s3 == cfg
    assert pickle.loads(pickle.dumps(job)).s3 == cfg  # what a Dask worker receives
    assert "s3-keys" in job.model_dump_json()  # the secret's *name* travels, never its value


def test_endpoint_from_config_else_environment(monkeypatch):
    for v in st._ENDPOINT_ENV:
        monkeypatch.delenv(v, raising=False)
    assert st.S3Config().endpoint() is None
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://env:1")
    assert st.S3Config().endpoint() == "http://env:1"
    assert st.S3Config(endpoint_url="http://cfg:2").endpoint() == "http://cfg:2"


def test_secret_resolver_gives_the_client_its_keys_and_errors_hide_them(monkeypatch):
    monkeypatch.setattr(st, "_resolver", None)
    st._secret.cache_clear()
    st._client.cache_clear()
    cfg = st.S3Config(endpoint_url="http://127.0.0.1:9", credentials_secret="keys-a")
    with pytest.raises(StorageError, match="'keys-a': no secret resolver"):
        st.s3_client(cfg)
    st.set_secret_resolver(lambda name: ("AKIDFROMBLOCK", "s3cr3t-value") if name == "keys-a" else 1 / 0)
    try:
        creds = st.s3_client(cfg)._request_signer._credentials
        assert (creds.access_key, creds.secret_key) == ("AKIDFROMBLOCK", "s3cr3t-value")
        with pytest.raises(StorageError, match="'keys-b': cannot read it \\(ZeroDivisionError\\)"):
            st.s3_client(cfg.model_copy(update={"credentials_secret": "keys-b"}))
        assert "s3cr3t" not in repr(cfg) and "s3cr3t" not in cfg.model_dump_json()
    finally:
        st.set_secret_resolver(None)
        st._secret.cache_clear()
        st._client.cache_clear()


def test_work_folder_placement(monkeypatch, tmp_path):
    monkeypatch.delenv("NIGHTLOOM_SHARD_WORKDIR", raising=False)
    assert default_workdir(str(tmp_path), "h") == f"{tmp_path}/{WORK_DIR_NAME}/h-w{WORK_FORMAT}"
    assert default_workdir("s3://b/out", "h", distributed=True) == f"s3://b/out/{WORK_DIR_NAME}/h-w{WORK_FORMAT}"
    assert not default_workdir("s3://b/out", "h").startswith("s3://")  # one machine: the local temp dir
    monkeypatch.setenv("NIGHTLOOM_SHARD_WORKDIR", "s3://b/work")
    assert default_workdir(str(tmp_path), "h") == f"s3://b/work/h-w{WORK_FORMAT}"
    monkeypatch.delenv("NIGHTLOOM_SHARD_WORKDIR")
    sharding = ShardingSpec(output="s3://b/out", num_shards=2, dask=DaskSpec(address="tcp://127.0.0.1:1"))
    assert default_workdir(sharding.output, "h", distributed=sharding.dask is not None).startswith("s3://b/out/")


def test_workdir_local_and_cache_path(monkeypatch, tmp_path):
    local = WorkDir(str(tmp_path / "w"))
    assert not local.remote and local.path("x") == tmp_path / "w" / "x"
    assert local.marker("scan-00000.json") is None
    local.write_marker("scan-00000.json", b"{}")
    assert local.marker("scan-00000.json") == b"{}"
    local.publish("scan-00000.json")  # nothing to upload for a local folder
    monkeypatch.setenv("NIGHTLOOM_SHARD_CACHE", str(tmp_path / "cache"))
    remote = WorkDir("s3://bkt/out/.nightloom-work/h-w3")
    assert remote.remote and remote.local == tmp_path / "cache" / "bkt" / "out/.nightloom-work/h-w3"
    local.remove()
    assert not (tmp_path / "w").exists()


def test_old_train_job_with_bare_endpoint_still_loads(tmp_path):
    import json

    from nightloom.train.job import TrainJob
    from tests.support.harness import make_job

    path = make_job(tmp_path / "run", tmp_path / "shards", job_kw={"s3": st.S3Config(endpoint_url="http://s3:1")})
    data = json.loads(path.read_text())
    assert TrainJob.model_validate(data).s3.endpoint_url == "http://s3:1"
    del data["s3"]
    data["s3_endpoint_url"] = "http://old:2"  # a job.json written before the S3Config field
    assert TrainJob.model_validate(data).s3 == st.S3Config(endpoint_url="http://old:2")
    data["s3_endpoint_url"] = None
    assert TrainJob.model_validate(data).s3 == st.S3Config()
