"""The shard flow on a real Dask cluster (scheduler + 2 worker processes, .ci/services.sh), input and output on
a real S3 server: the same bytes as one machine, also when a worker is killed in the middle of the run."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from nightloom.sharding import job as job_module
from nightloom.sharding import load_manifest, shard_dataset
from nightloom.sharding import storage as st
from nightloom.spec import DaskSpec, DatasetSpec, RunSpec, ShardingSpec, StorageSpec
from tests.support.ci import skip_or_fail
from tests.support.s3 import upload
from tests.support.sharding import make_docs, write_jsonl

pytestmark = [pytest.mark.services, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def dask_address():
    addr = os.environ.get("DASK_SCHEDULER_ADDRESS")
    if not addr:
        skip_or_fail("DASK_SCHEDULER_ADDRESS not set: run `.ci/services.sh start` and eval `.ci/services.sh env`")
    return addr


def _s3_corpus(url: str, bucket: str, tmp_path: Path, name: str) -> str:
    """Six JSONL inputs (one scan task each in these tests) with duplicates across them, uploaded to S3."""
    prefix = f"s3://{bucket}/{name}/in"
    docs = make_docs(6000, seed=21, dup_every=9)
    for i in range(6):
        upload(
            url,
            write_jsonl(tmp_path / "in" / f"part-{i}.jsonl", docs[i * 1000 : (i + 1) * 1000]),
            f"{prefix}/part-{i}.jsonl",
        )
    return prefix


def _objects(url: str, prefix: str) -> dict[str, bytes]:
    st.configure_s3(url)
    return {rel: st.read_bytes(st.join(prefix, rel)) for rel, _ in st.list_files(prefix)}


def _worker_pids(address: str) -> list[int]:
    from distributed import Client

    with Client(address, timeout=10) as c:
        return sorted(c.run(os.getpid).values())  # {worker address: pid of its process}


def _run(spec: RunSpec):
    from flows.shard import shard_dataset_flow

    return shard_dataset_flow(spec, return_state=True)


def _spec(name: str, src: str, out: str, url: str, dask: str | None) -> RunSpec:
    return RunSpec(
        name=name,
        dataset=DatasetSpec(path=src),
        sharding=ShardingSpec(output=out, num_shards=4, tolerance=0.05, dask=DaskSpec(address=dask) if dask else None),
        storage=StorageSpec(s3_endpoint_url=url),
    )


def test_dask_shards_on_s3_equal_one_machine(prefect_backend, s3_endpoint, dask_address, tmp_path, monkeypatch):
    url, bucket = s3_endpoint
    monkeypatch.setattr(job_module, "UNIT_FILES", 1)  # one scan task per input: work for both workers
    monkeypatch.setenv("NIGHTLOOM_SHARD_WORKDIR", str(tmp_path / "work"))
    src = _s3_corpus(url, bucket, tmp_path, "dask1")
    storage = StorageSpec(s3_endpoint_url=url)
    alone = shard_dataset(
        DatasetSpec(path=src), ShardingSpec(output=f"s3://{bucket}/dask1/alone", num_shards=4, tolerance=0.05), storage
    )
    state = _run(_spec("dask-shard", src, f"s3://{bucket}/dask1/dask", url, dask_address))
    assert state.is_completed(), state.message
    on_dask = state.result()
    assert on_dask == alone and on_dask.dedup_dropped > 0
    assert _objects(url, f"s3://{bucket}/dask1/dask") == _objects(url, f"s3://{bucket}/dask1/alone")
    st.configure_s3(url)
    assert load_manifest(f"s3://{bucket}/dask1/dask") == alone


def test_dask_worker_killed_mid_run_same_bytes(prefect_backend, s3_endpoint, dask_address, tmp_path, monkeypatch):
    url, bucket = s3_endpoint
    monkeypatch.setattr(job_module, "UNIT_FILES", 1)
    work = tmp_path / "work"
    monkeypatch.setenv("NIGHTLOOM_SHARD_WORKDIR", str(work))
    src = _s3_corpus(url, bucket, tmp_path, "dask2")
    storage = StorageSpec(s3_endpoint_url=url)
    alone = shard_dataset(
        DatasetSpec(path=src), ShardingSpec(output=f"s3://{bucket}/dask2/alone", num_shards=4, tolerance=0.05), storage
    )
    victim = _worker_pids(dask_address)[0]
    killed = threading.Event()

    def kill_after_first_scan() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed.is_set():
            if list(work.glob("*/scan-*.json")):  # the run is under way: some scans done, others pending
                os.kill(victim, signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_after_first_scan, daemon=True)
    watcher.start()
    spec = _spec("dask-kill", src, f"s3://{bucket}/dask2/dask", url, dask_address)
    state = _run(spec)
    watcher.join(5)
    assert killed.is_set(), "the run ended before a worker could be killed"
    if not state.is_completed():  # the lost task failed the run: a re-run resumes from the finished work
        state = _run(spec)
    assert state.is_completed(), state.message
    assert state.result() == alone
    assert _objects(url, f"s3://{bucket}/dask2/dask") == _objects(url, f"s3://{bucket}/dask2/alone")
    # the nanny restarts the killed worker: the cluster is whole again for the next test
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_worker_pids(dask_address)) < 2:
        time.sleep(0.5)
    assert len(_worker_pids(dask_address)) >= 2
