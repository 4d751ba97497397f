"""The nightly-queue service tests' helpers: deploy it on the real Prefect server, job specs for a queue, a flow
run's final state and its log lines."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from tests.support.pipeline import demo_data
from tests.support.prefect_server import client, deploy, wait_final

WINDOW = {"start": "02:00", "end": "06:00"}


def deploy_nightly_queue() -> str:
    """`prefect deploy --name nightly-queue` on the server of $PREFECT_API_URL (skip outside CI without one)."""
    deploy("--name", "nightly-queue")
    return "nightly-queue/nightly-queue"


def job_spec(
    folder: Path,
    name: str,
    steps: int,
    ledger: str,
    *,
    cluster: str,
    policy: str = "split",
    provider: dict | None = None,
    dataset: Path | None = None,
) -> Path:
    """The demo spec on one node of one rank, in the 02:00-06:00 window, its ledger `ledger`, cluster name
    `cluster` (jobs may share one: the queue keys each stretch's lock by its nodes), its own rendezvous port."""
    from nightloom.provision.local import free_port

    data = demo_data(folder, steps=steps, checkpoint_every=0, seq_len=128, global_batch=16)
    data["name"] = name
    data["cluster"].update({"name": cluster, "nodes": 1, "gpus_per_node": 1, "master_port": free_port()})
    if provider is not None:
        data["cluster"]["provider"] = provider
    if dataset is not None:
        data["dataset"].update({"path": str(dataset), "sample": False})
    data["schedule"] = {
        "timezone": "Asia/Shanghai",
        "windows": [WINDOW],
        "policy": policy,
        "price_per_gpu_hour": 3600.0,
        "offpeak_discount": 0.5,
        "provisioning_minutes": 0.05,
    }
    data["ledger"]["url"] = ledger
    p = folder / "spec.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(data))
    return p


def run_night(deployment: str, params: dict, timeout: float = 900):
    """Start a run of the deployment and wait for its final state (the flow run, read back)."""
    from prefect.deployments import run_deployment

    return wait_final(run_deployment(deployment, parameters=params, timeout=0).id, timeout=timeout)


def log_lines(flow_run_id, until: str | None = None, timeout: float = 60) -> list[str]:
    """The flow run's log messages (its tasks' included), oldest first; with `until`, read again until one is that
    line (logs reach the server after the run's final state) or `timeout` seconds pass."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    with client() as c:
        while True:
            flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            lines = [x.message for x in c.read_logs(log_filter=flt, limit=200)]
            if until is None or until in lines or time.monotonic() > deadline:
                return lines
            time.sleep(1)


def subflow_names(flow_run_id) -> dict[str, str]:
    """The subflow runs of a flow run: name → state."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with client() as c:
        runs = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
    return {r.name: r.state.type.value for r in runs}


def lock_names() -> set[str]:
    """The names of the server's global concurrency limits (the pipeline's cluster locks among them)."""
    with client() as c:
        return {x.name for x in c.read_global_concurrency_limits(limit=200)}
