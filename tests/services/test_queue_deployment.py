"""The nightly-queue deployment against a real Prefect server and process worker (started by .ci/run via
.ci/services.sh): two jobs in a 2-node queue over two simulated nights (`at` near the end of the 02:00-06:00
window, so each night is short in real time). Night 1 runs both side by side (one pipeline subflow each, on nodes 0
and 1): the long split job stops at the window's end with a checkpoint, the short one completes. Night 2 plans
what is left: only the split job, which resumes its run (same run id, more steps). The ledger's queue records each
night per job; the Gantt chart is an artifact and a PNG in the run folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.ci import skip_or_fail
from tests.support.pipeline import artifacts_of, demo_data

ROOT = Path(__file__).resolve().parents[2]
WINDOW = {"start": "02:00", "end": "06:00"}
# 90 s before each window's end: shard, tokenizer, provisioning and trainer start-up of two runs side by side on a
# 2-core box, then some steps
NIGHT_1, NIGHT_2 = "2026-12-01T05:58:30+08:00", "2026-12-02T05:58:30+08:00"

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def deployment():
    if not os.environ.get("PREFECT_API_URL"):
        skip_or_fail("needs a Prefect server and a worker on pool local-pool (PREFECT_API_URL; .ci/services.sh)")
    r = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--name", "nightly-queue"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return "nightly-queue/nightly-queue"


def job_spec(folder: Path, name: str, steps: int, ledger: str) -> Path:
    """The demo spec on one local node of one rank, its own cluster (its own lock) and port, split in the window."""
    from nightloom.provision.local import free_port

    data = demo_data(folder, steps=steps, checkpoint_every=0, seq_len=128, global_batch=16)
    data["name"] = name
    data["cluster"].update({"name": f"queue-{name}", "nodes": 1, "gpus_per_node": 1, "master_port": free_port()})
    data["schedule"] = {
        "timezone": "Asia/Shanghai",
        "windows": [WINDOW],
        "policy": "split",
        "price_per_gpu_hour": 3600.0,
        "offpeak_discount": 0.5,
        "provisioning_minutes": 0.05,
    }
    data["ledger"]["url"] = ledger
    p = folder / "spec.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(data))
    return p


def wait_final(flow_run_id, timeout=900):
    from prefect import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as c:
        while time.monotonic() < deadline:
            fr = c.read_flow_run(flow_run_id)
            if fr.state and fr.state.is_final():
                return fr
            time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} not final after {timeout} s")


def test_two_jobs_over_two_nights(deployment, tmp_path):
    from prefect.deployments import run_deployment

    from flows.cli import main
    from nightloom.ledger import Ledger
    from nightloom.queue_store import QueueStore

    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    long_job = job_spec(tmp_path / "long", "long", 100_000, ledger)  # never finishes: each window's end stops it
    short_job = job_spec(tmp_path / "short", "short", 8, ledger)
    assert main(["queue", "create", "team", "--max-nodes", "2", "--ledger", ledger]) == 0
    assert main(["queue", "add", "team", str(long_job), "--priority", "1", "--hours", "10", "--ledger", ledger]) == 0
    assert (
        main(["queue", "add", "team", str(short_job), "--priority", "2", "--hours", "0.005", "--ledger", ledger]) == 0
    )

    nights = []
    for at in (NIGHT_1, NIGHT_2):
        params = {"queue": "team", "ledger": ledger, "at": at}
        fr = wait_final(run_deployment(deployment, parameters=params, timeout=0).id)
        assert fr.state.is_completed(), fr.state.message
        nights.append(fr)

    with Ledger(ledger) as lg:
        store = QueueStore(lg)
        jobs = {j.name: j for j in store.jobs("team")}
        runs = store.runs("team")
    long_id, short_id = jobs["long"].id, jobs["short"].id
    n1 = [r for r in runs if r.night == runs[0].night]
    n2 = [r for r in runs if r.night != runs[0].night]
    by1 = {r.job_id: r for r in n1}
    # night 1: both jobs side by side on disjoint nodes; the long one split at the window's end, the short one done
    assert set(by1) == {long_id, short_id} and sorted(by1[long_id].nodes + by1[short_id].nodes) == [0, 1], n1
    assert (by1[long_id].status, by1[long_id].job_status) == ("split", "split"), by1[long_id]
    assert (by1[short_id].status, by1[short_id].job_status, by1[short_id].steps_done) == ("completed", "done", 8)
    assert 0 < by1[long_id].steps_done < 100_000 and by1[long_id].hours_trained > 0
    # night 2: only what was left; the split job resumed its run and trained more steps
    assert [r.job_id for r in n2] == [long_id], n2
    (again,) = n2
    assert again.run_id == by1[long_id].run_id and again.status == "split"
    assert again.steps_done > by1[long_id].steps_done
    assert (jobs["long"].status, jobs["short"].status) == ("split", "done")
    assert all(r.flow_run_id for r in runs)
    with Ledger(ledger) as lg:
        row = lg.get(again.run_id)
    assert [n.night for n in row.nights] == [1, 2]
    # the Gantt chart: an artifact of each night's run and a PNG in the run folder
    for fr in nights:
        assert "queue-gantt" in {a.key for a in artifacts_of(fr.id)}
    charts = sorted((tmp_path / "long" / "runs" / "queues" / "team").rglob("gantt.png"))
    assert [c.parent.name for c in charts] == ["20261201-0200", "20261202-0200"]
    assert all(c.read_bytes()[:4] == b"\x89PNG" for c in charts)
