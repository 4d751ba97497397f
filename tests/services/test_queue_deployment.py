"""The nightly-queue deployment against a real Prefect server and process worker (started by .ci/run via
.ci/services.sh): two jobs in a 2-node queue over two simulated nights (`at` near the end of the 02:00-06:00
window, so each night is short in real time). Night 1 runs both side by side (one pipeline subflow each, on nodes 0
and 1): the long split job stops at the window's end with a checkpoint, the short one completes. Night 2 plans
what is left: only the split job, which resumes its run (same run id, more steps). The ledger's queue records each
night per job; the Gantt chart is an artifact and a PNG in the run folder.
"""

from __future__ import annotations

import pytest

from tests.support.pipeline import artifacts_of
from tests.support.queue_services import (
    deploy_nightly_queue,
    job_spec,
    lock_names,
    log_lines,
    run_night,
    subflow_names,
)

# 90 s before each window's end: shard, tokenizer, provisioning and trainer start-up of two runs side by side on a
# 2-core box, then some steps
NIGHT_1, NIGHT_2 = "2026-12-01T05:58:30+08:00", "2026-12-02T05:58:30+08:00"

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def deployment():
    return deploy_nightly_queue()


def test_a_queue_not_made_yet_is_nothing_to_run(deployment, tmp_path):
    """The deployment's cron is active once deployed: a night before anyone made the queue completes, saying so."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    fr = run_night(deployment, {"ledger": ledger}, timeout=300)  # the default queue: team
    assert fr.state.is_completed(), fr.state.message
    line = f"no queue named team in {ledger}; nothing to run"
    assert line in log_lines(fr.id, until=line)
    assert subflow_names(fr.id) == {}


def test_two_jobs_over_two_nights(deployment, tmp_path):
    from flows.cli import main
    from nightloom.ledger import Ledger
    from nightloom.queue.store import QueueStore

    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    # both on one cluster.name: the queue keys each stretch's lock by its nodes, so they still run side by side
    long_job = job_spec(tmp_path / "long", "long", 100_000, ledger, cluster="queue-team")  # each window's end stops it
    short_job = job_spec(tmp_path / "short", "short", 8, ledger, cluster="queue-team")
    assert main(["queue", "create", "team", "--max-nodes", "2", "--ledger", ledger]) == 0
    assert main(["queue", "add", "team", str(long_job), "--priority", "1", "--hours", "10", "--ledger", ledger]) == 0
    assert (
        main(["queue", "add", "team", str(short_job), "--priority", "2", "--hours", "0.005", "--ledger", ledger]) == 0
    )

    nights = []
    for at in (NIGHT_1, NIGHT_2):
        params = {"queue": "team", "ledger": ledger, "at": at}
        fr = run_night(deployment, params)
        assert fr.state.is_completed(), fr.state.message
        nights.append(fr)
        print(f"\nnight {at}: flow run {fr.name} {fr.state.type.value}; subflows {subflow_names(fr.id)}")

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
    # side by side though they share a cluster name: each stretch held a lock of its own nodes, none the cluster's
    limits = lock_names()
    assert {"cluster-queue-team-nodes-0", "cluster-queue-team-nodes-1"} <= limits and "cluster-queue-team" not in limits
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
    for r in runs:
        print(
            f"ledger: night {r.night} job {r.job_id} nodes {r.nodes} run {r.run_id} {r.status} -> {r.job_status}, "
            f"{r.steps_done} steps, {r.hours_trained:.4f} h"
        )
    print("gantt:", *charts)
