"""The service tests' one way to a real Prefect server (started by .ci/run via .ci/services.sh, or any server in
PREFECT_API_URL): deploy the project's deployments there, a sync client, and wait for a flow run's final state."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.support.ci import skip_or_fail
from tests.support.harness import ROOT

NEEDS_SERVER = "needs a Prefect server and a worker on pool local-pool (PREFECT_API_URL; .ci/services.sh starts them)"


def deploy(*select: str) -> str:
    """`prefect deploy` on the server of $PREFECT_API_URL: every deployment of prefect.yaml, or those `select`
    names (e.g. "--name", "nightly-queue"); returns the API URL. Skips outside CI without a server, fails in CI."""
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        skip_or_fail(NEEDS_SERVER)
    r = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", *(select or ("--all",))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return url


def client():
    from prefect import get_client

    return get_client(sync_client=True)


def wait_final(flow_run_id, timeout: float = 420, poll: float = 1.0):
    """The flow run, read back once its state is final; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    with client() as c:
        while time.monotonic() < deadline:
            fr = c.read_flow_run(flow_run_id)
            if fr.state and fr.state.is_final():
                return fr
            time.sleep(poll)
    raise AssertionError(f"flow run {flow_run_id} not final after {timeout} s")
