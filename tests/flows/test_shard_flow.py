"""The `shard-dataset` flow against a real (temporary) Prefect API: shards, table artifact, reuse, failure."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from nightloom.sharding import TooSmallError, load_manifest, shard_dataset
from nightloom.spec import RunSpec
from tests.support.pipeline import artifacts_of
from tests.support.sharding import make_docs, write_jsonl

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # a session harness or a real server is already there
        yield PREFECT_API_URL.value()
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


def table_verdict(state) -> str:
    arts = artifacts_of(state.state_details.flow_run_id)
    table = next(a for a in arts if a.key == "shard-report")
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    return rows[-1]["verdict"]


def _spec(tmp_path, **sharding) -> RunSpec:
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(900, seed=8, dup_every=6, skew=True))
    return RunSpec(
        name="shard-test",
        dataset={"path": str(src)},
        sharding={"num_shards": 4, "output": str(tmp_path / "out"), "tolerance": 0.02, **sharding},
    )


def test_flow_shards_reports_and_reuses(prefect_api, tmp_path):
    from flows.shard import shard_dataset_flow

    spec = _spec(tmp_path)
    state = shard_dataset_flow(spec, return_state=True)
    assert state.is_completed(), state
    manifest = state.result()
    assert manifest == load_manifest(tmp_path / "out")
    # token files (.bin/.idx) next to every Parquet shard, as the shard-only deployment writes them
    assert all(s.token_files is not None and s.token_files.documents == s.rows for s in manifest.shards)
    assert all((tmp_path / "out" / f).is_file() for s in manifest.shards for f in s.files())
    assert "token files: 4 .bin/.idx pairs" in table_verdict(state)
    # the same function outside Prefect gives the same manifest (flow = orchestration only)
    assert manifest == shard_dataset(spec.dataset, spec.sharding.model_copy(update={"output": str(tmp_path / "o2")}))
    arts = artifacts_of(state.state_details.flow_run_id)
    table = next(a for a in arts if a.key == "shard-report")
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [r["rows"] for r in rows[:-1]] == [s.rows for s in manifest.shards]
    assert ("balanced: imbalance" in rows[-1]["verdict"]) == manifest.balanced
    # the string path (a spec YAML, as the CLI and a deployment pass it) gives the same manifest, reused
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", by_alias=True)))
    again = shard_dataset_flow(str(path), return_state=True)
    assert again.is_completed(), again
    assert again.result() == manifest
    reused = next(a for a in artifacts_of(again.state_details.flow_run_id) if a.key == "shard-report")
    assert "reused" in (reused.description or "")


def test_flow_fails_with_a_clear_reason(prefect_api, tmp_path):
    from flows.shard import shard_dataset_flow

    src = tmp_path / "tiny.jsonl"
    src.write_text('{"text": "%s"}\n{"text": "a"}\n{"text": "b"}\n' % ("x" * 2000))
    spec = RunSpec(name="t", dataset={"path": str(src)}, sharding={"num_shards": 2, "output": str(tmp_path / "o")})
    state = shard_dataset_flow(spec, return_state=True)
    assert state.is_failed()
    with pytest.raises(TooSmallError, match="need at least"):
        state.result()
    md = next(a for a in artifacts_of(state.state_details.flow_run_id) if a.key == "shard-report")
    assert "need at least" in md.data
