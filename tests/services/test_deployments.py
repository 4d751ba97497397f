"""Deployments against a real Prefect server and process worker (started by .ci/run via .ci/services.sh).

deploy --all; trigger `on-demand` with parameters and see it complete on the worker with its artifacts; a
`wait` run outside the window schedules the next run at the window start; two runs on one cluster are
serialised; cancelling a run mid-training leaves no process of ours behind.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from tests.support.pipeline import demo_data
from tests.support.prefect_server import client, deploy, wait_final

ROOT = Path(__file__).resolve().parents[2]
POOL = os.environ.get("PREFECT_WORK_POOL", "local-pool")

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def server():
    return deploy()


def inline_spec(tmp_path: Path, **over) -> dict:
    """The demo spec as the UI form would send it, with outputs under tmp_path and a short run."""
    data = demo_data(tmp_path, steps=6, checkpoint_every=0)
    # one node × 2 ranks (the demo has 2 × 2): these tests are about the worker, not the layout, and on 2 cores
    # each torchrun agent and rank costs seconds of start-up
    data["cluster"].update({"nodes": 1, "gpus_per_node": 2})
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def test_on_demand_run_completes_on_worker_with_artifacts(server, tmp_path):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.deployments import run_deployment

    fr = run_deployment("training-pipeline/on-demand", parameters={"spec": inline_spec(tmp_path)}, timeout=0)
    fr = wait_final(fr.id)
    assert fr.state.is_completed(), fr.state.message
    with client() as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
    assert {"run-summary", "plan", "loss-curve"} <= {a.key for a in arts}
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "metrics.jsonl").is_file()


def test_wait_outside_window_schedules_next_window_run(server, tmp_path):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter
    from prefect.deployments import run_deployment

    tz = ZoneInfo("Asia/Shanghai")
    start = (datetime.now(tz) + timedelta(hours=3)).replace(second=0, microsecond=0)
    window = {"start": start.strftime("%H:%M"), "end": (start + timedelta(hours=1)).strftime("%H:%M")}
    spec = inline_spec(tmp_path, schedule={"policy": "wait", "windows": [window], "timezone": "Asia/Shanghai"})
    fr = wait_final(run_deployment("training-pipeline/on-demand", parameters={"spec": spec}, timeout=0).id)
    assert fr.state.is_completed(), fr.state.message
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("metrics.jsonl"))
    with client() as c:
        runs = c.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["on-demand"])),
            flow_run_filter=FlowRunFilter(),
        )
        scheduled = [
            r
            for r in runs
            if r.state
            and r.state.is_scheduled()
            and r.parameters.get("spec", {}).get("storage", {}).get("root") == spec["storage"]["root"]
        ]
        try:
            assert len(scheduled) == 1, [(r.name, r.state) for r in runs]
            when = scheduled[0].next_scheduled_start_time or scheduled[0].expected_start_time
            assert abs((when - start).total_seconds()) < 1, (when, start)
        finally:
            for r in scheduled:
                c.delete_flow_run(r.id)


def test_two_runs_on_one_cluster_are_serialised(server, tmp_path):
    from prefect.deployments import run_deployment

    runs = []
    for i in range(2):
        spec = inline_spec(tmp_path / f"r{i}", cluster={"name": "shared-ci"})
        runs.append(run_deployment("training-pipeline/on-demand", parameters={"spec": spec}, timeout=0).id)
    finals = [wait_final(r, timeout=600) for r in runs]
    assert all(f.state.is_completed() for f in finals), [f.state.message for f in finals]
    spans = []
    for i in range(2):
        (run_dir,) = list((tmp_path / f"r{i}" / "runs").iterdir())
        times = [json.loads(x)["time"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        spans.append((min(times), max(times)))
    (a0, a1), (b0, b1) = sorted(spans)
    assert a1 <= b0, f"training of the two runs overlapped: {spans}"


def our_processes(marker: str) -> list[str]:
    """Command lines (from /proc, untruncated) of live processes that mention `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z" and proc.name != str(os.getpid()):
            found.append(f"{proc.name} {cmd}")
    return found


def test_cancel_mid_training_leaves_no_process(server, tmp_path):
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    spec = inline_spec(tmp_path, train={"steps": 100000, "checkpoint_every": 0})
    fr = run_deployment("training-pipeline/on-demand", parameters={"spec": spec}, timeout=0)
    try:
        deadline = time.monotonic() + 300
        metrics = None
        while time.monotonic() < deadline:
            found = list((tmp_path / "runs").rglob("metrics.jsonl")) if (tmp_path / "runs").exists() else []
            if found and len(found[0].read_text().splitlines()) >= 3:
                metrics = found[0]
                break
            time.sleep(1)
        assert metrics is not None, "training never started"
        marker = str(metrics.parent)  # every rank's command line names its job file in the run folder
        assert our_processes(marker), "expected training processes while running"
    finally:
        with client() as c:  # cancel from the API, as the UI's Cancel button does
            c.set_flow_run_state(fr.id, Cancelling(), force=True)
    final = wait_final(fr.id, timeout=120)
    assert final.state.is_cancelled(), final.state
    deadline = time.monotonic() + 30
    while our_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not our_processes(marker), our_processes(marker)
