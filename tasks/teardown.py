"""Teardown that survives the flow's own process: a record on disk, read by state hooks.

After provisioning the flow writes `cluster.json`, and after launching `processes.json` (process-group ids),
into the run folder (names: nightloom.runfiles). On cancellation or crash the hook re-creates the provider from the spec, releases the
recorded cluster (scancel, delete the Job, ...) and kills the recorded process groups.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from nightloom.provision.base import Cluster
from nightloom.runfiles import RunFiles
from nightloom.util import atomic_write_text


def record_cluster(run_dir: Path, cluster: Cluster) -> None:
    """Every node the run holds, for a teardown that runs outside the flow."""
    atomic_write_text(RunFiles(run_dir).cluster, cluster.model_dump_json())


def record_processes(run_dir: Path, pgids: list[int]) -> None:
    """The launch's local process groups, for a teardown that runs outside the flow."""
    atomic_write_text(RunFiles(run_dir).processes, json.dumps({"pgids": pgids, "host_pid": os.getpid()}))


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_recorded_processes(run_dir: Path, grace_s: float = 5.0) -> list[int]:
    """TERM, wait, KILL every recorded process group; return the groups that were still alive."""
    path = RunFiles(run_dir).processes
    if not path.is_file():
        return []
    pgids = [g for g in json.loads(path.read_text()).get("pgids", []) if _alive(g)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in pgids:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(g) for g in pgids):
            time.sleep(0.1)
    return pgids


def run_dirs_of_flow_run(spec, flow_run_id: str) -> list[Path]:
    root = Path(spec.storage.root)
    return sorted(root.glob(f"*-{str(flow_run_id)[:8]}")) if root.is_dir() else []


def teardown_hook(flow, flow_run, state) -> None:
    """on_cancellation / on_crashed: release whatever this flow run acquired (idempotent)."""
    from nightloom.spec.load import coerce_spec
    from tasks.provision import make_provider

    try:
        spec = coerce_spec(flow_run.parameters["spec"])
    except Exception as e:  # a spec that never validated never acquired anything
        print(f"teardown: no valid spec ({type(e).__name__}); nothing to release")
        return
    dirs = run_dirs_of_flow_run(spec, flow_run.id)
    resume = flow_run.parameters.get("resume_run_id")
    if resume:
        dirs.append(Path(spec.storage.root) / resume)
    for run_dir in dirs:
        killed = kill_recorded_processes(run_dir)
        cfile = RunFiles(run_dir).cluster
        if cfile.is_file():
            cluster = Cluster.model_validate_json(cfile.read_text())
            make_provider(spec).release(cluster)
        print(f"teardown of {run_dir.name}: killed {len(killed)} process group(s), released cluster")
