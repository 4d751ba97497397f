"""The shard flow on a real Dask cluster (scheduler + 2 worker processes, .ci/services.sh) with input, output and
the work folder on a real S3 server and no local folder shared between the processes: the same bytes as one
machine (with near-dup and a filter on: the same kept set), also when a worker is killed in the middle of the
run."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from nightloom import storage as st
from nightloom.sharding import load_manifest, shard_dataset
from nightloom.sharding import prepare as plan_module
from nightloom.sharding.corpus import ensure_sample_corpus
from nightloom.sharding.planted import planted_corpus
from nightloom.spec import DaskSpec, DatasetSpec, RunSpec, ShardingSpec, StorageSpec
from nightloom.spec.quality import C4Spec, FiltersSpec, LengthSpec, NearDupSpec
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


def _own_cache(root: str, dask_worker) -> str:
    """Runs in each worker process: its own work cache, so no local folder is shared with anyone."""
    path = f"{root}/{dask_worker.name}-{os.getpid()}"
    os.environ["NIGHTLOOM_SHARD_CACHE"] = path
    return path


@pytest.fixture
def isolated(dask_address, tmp_path, monkeypatch):
    """No shared local work folder: the flow process and every worker cache work files in folders of their own,
    and NIGHTLOOM_SHARD_WORKDIR is unset, so the work folder is derived from the S3 output."""
    from distributed import Client

    monkeypatch.delenv("NIGHTLOOM_SHARD_WORKDIR", raising=False)
    monkeypatch.setenv("NIGHTLOOM_SHARD_CACHE", str(tmp_path / "cache-flow"))
    with Client(dask_address, timeout=10) as c:
        caches = c.run(_own_cache, str(tmp_path / "cache-worker"))
    assert len(set(caches.values())) >= 2, caches
    return tmp_path


def _s3_corpus(url: str, bucket: str, tmp_path: Path, name: str, planted: int = 0) -> str:
    """Six JSONL inputs (one scan task each in these tests) with duplicates across them, uploaded to S3; with
    `planted`, a corpus of that many originals with planted near-duplicates (nightloom.sharding.planted) is
    dealt over them too, so a cluster's members sit in different units."""
    prefix = f"s3://{bucket}/{name}/in"
    docs = make_docs(6000, seed=21, dup_every=9)
    texts = planted_corpus(planted, seed=5).texts + _docstrings(300) if planted else []
    order = np.random.default_rng(5).permutation(len(texts))
    for i in range(6):
        part = docs[i * 1000 : (i + 1) * 1000] + [texts[k] for k in order[i::6]]
        upload(url, write_jsonl(tmp_path / "in" / f"part-{i}.jsonl", part), f"{prefix}/part-{i}.jsonl")
    return prefix


def _docstrings(n: int) -> list[str]:
    """The first n documents of the sample corpus (real docstrings, many lines: C4 edits them)."""
    path = ensure_sample_corpus(Path(__file__).resolve().parents[2] / "datasets" / "sample" / "corpus.jsonl")
    return [orjson.loads(x)["text"] for x in path.read_bytes().splitlines()[:n]]


def _objects(url: str, prefix: str) -> dict[str, bytes]:
    s3 = st.S3Config(endpoint_url=url)
    return {rel: st.read_bytes(st.join(prefix, rel), s3) for rel, _ in st.list_files(prefix, s3)}


def _worker_pids(address: str) -> list[int]:
    from distributed import Client

    with Client(address, timeout=10) as c:
        return sorted(c.run(os.getpid).values())  # {worker address: pid of its process}


def _run(spec: RunSpec):
    from flows.shard import shard_dataset_flow

    return shard_dataset_flow(spec, return_state=True)


def _spec(name: str, src: str, out: str, url: str, dask: str | None, **quality) -> RunSpec:
    return RunSpec(
        name=name,
        dataset=DatasetSpec(path=src),
        sharding=ShardingSpec(
            output=out, num_shards=4, tolerance=0.05, dask=DaskSpec(address=dask) if dask else None, **quality
        ),
        storage=StorageSpec(s3_endpoint_url=url),
    )


def _one_machine(src: str, out: str, url: str, **quality):
    """The reference: the same settings sharded in this process (work in the local temp dir)."""
    sharding = ShardingSpec(output=out, num_shards=4, tolerance=0.05, **quality)
    return shard_dataset(DatasetSpec(path=src), sharding, StorageSpec(s3_endpoint_url=url))


def test_dask_shards_on_s3_equal_one_machine(prefect_backend, s3_endpoint, dask_address, isolated, monkeypatch):
    url, bucket = s3_endpoint
    monkeypatch.setattr(plan_module, "UNIT_FILES", 1)  # one scan task per input: work for both workers
    src = _s3_corpus(url, bucket, isolated, "dask1", planted=300)
    # near-dup and filters on: signatures per unit on the workers, band keys joined into clusters at place; C4's
    # line rules (not its document ones: the synthetic texts have no sentences) rewrite the docstrings' spills
    c4 = C4Spec(filter_no_terminal_punct=False, min_num_sentences=-1)
    quality = {"near_dup": NearDupSpec(), "filters": FiltersSpec(length=LengthSpec(min_words=8), c4=c4)}
    alone = _one_machine(src, f"s3://{bucket}/dask1/alone", url, **quality)
    out = f"s3://{bucket}/dask1/dask"
    state = _run(_spec("dask-shard", src, out, url, dask_address, **quality))
    assert state.is_completed(), state.message
    on_dask = state.result()
    assert on_dask == alone and on_dask.dedup_dropped > 0
    removed = on_dask.quality.removed
    assert removed["near_dup"].documents > 100 and removed["length"].documents > 100, removed
    assert removed["c4"].documents > 0, removed  # a curly bracket
    got = _objects(url, out)
    assert got == _objects(url, f"s3://{bucket}/dask1/alone")
    assert not [k for k in got if k.startswith(plan_module.WORK_DIR_NAME)]  # the S3 work folder is cleaned up
    assert load_manifest(out, st.S3Config(endpoint_url=url)) == alone
    left = [p for p in isolated.rglob("*") if p.is_file() and "cache-" in str(p.relative_to(isolated))]
    assert not left, left  # every process's cached copies of the S3 work folder are gone


def test_dask_worker_killed_mid_run_same_bytes(prefect_backend, s3_endpoint, dask_address, isolated, monkeypatch):
    url, bucket = s3_endpoint
    monkeypatch.setattr(plan_module, "UNIT_FILES", 1)
    src = _s3_corpus(url, bucket, isolated, "dask2")
    alone = _one_machine(src, f"s3://{bucket}/dask2/alone", url)
    out = f"s3://{bucket}/dask2/dask"
    work = st.join(out, plan_module.WORK_DIR_NAME)
    s3 = st.S3Config(endpoint_url=url)
    victim = _worker_pids(dask_address)[0]
    killed = threading.Event()
    seen: list[str] = []

    def kill_after_first_scan() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed.is_set():
            seen[:] = [rel for rel, _ in st.list_files(work, s3)]
            if any(Path(rel).name.startswith("scan-") for rel in seen):  # under way: some scans done on S3
                os.kill(victim, signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_after_first_scan, daemon=True)
    watcher.start()
    spec = _spec("dask-kill", src, out, url, dask_address)
    state = _run(spec)
    watcher.join(5)
    assert killed.is_set(), "the run ended before a worker could be killed"
    assert any(rel.endswith(".arrow") for rel in seen), seen  # spills live on S3, not on a shared disk
    if not state.is_completed():  # the lost task failed the run: a re-run resumes from the finished work on S3
        state = _run(spec)
    assert state.is_completed(), state.message
    assert state.result() == alone
    assert _objects(url, out) == _objects(url, f"s3://{bucket}/dask2/alone")
    # the nanny restarts the killed worker: the cluster is whole again for the next test
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_worker_pids(dask_address)) < 2:
        time.sleep(0.5)
    assert len(_worker_pids(dask_address)) >= 2
