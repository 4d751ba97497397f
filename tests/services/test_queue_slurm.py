"""The nightly-queue deployment with its jobs on the real Slurm (slurmctld + slurmd n1, n2) and the real Prefect
server and process worker CI starts (.ci/services.sh). Two 1-node jobs share a cluster name in a 2-node queue of
partition debug. Night 1: `fixme` (priority 1, node 0) fails in its pipeline, its corpus corrupt; `ok` (node 1)
completes on n2, where the queue pinned it (`--nodelist`; alone, Slurm would give it n1). Night 2 plans `fixme`
again, its corpus now gone: its spec no longer validates, and the night fails before any pipeline. Night 3, the
corpus back: it completes on n1. The ledger's queue records every night.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.harness import ROOT
from tests.support.queue_services import deploy_nightly_queue, job_spec, run_night, subflow_names

pytestmark = [pytest.mark.services, pytest.mark.timeout(1800)]

NIGHTS = ("2026-12-01T02:00:00+08:00", "2026-12-02T02:00:00+08:00", "2026-12-03T02:00:00+08:00")
SLURM = {"kind": "slurm", "partition": "debug", "time_limit": "00:20:00"}


def allocations(folder: Path) -> list[tuple[str, str]]:
    """Each Slurm allocation the job's runs made: (its #SBATCH --nodelist line, the node Slurm gave it)."""
    out = []
    for script in sorted((folder / "runs" / "slurm").glob("*/allocation.sbatch")):
        pin = next((ln for ln in script.read_text().splitlines() if "--nodelist" in ln), "")
        out.append((pin, (script.parent / "nodes").read_text().strip()))
    return out


def test_slurm_jobs_pinned_to_their_nodes_and_a_failed_night_planned_again(slurm, tmp_path):
    from flows.cli import main
    from nightloom.ledger import Ledger
    from nightloom.queue.store import QueueStore

    deployment = deploy_nightly_queue()
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    data = tmp_path / "fixme" / "corpus.jsonl"
    data.parent.mkdir(parents=True)
    shutil.copy(ROOT / "datasets" / "sample" / "corpus.jsonl", data)
    common = dict(cluster="ci-slurm", policy="wait", provider=SLURM)
    fixme = job_spec(tmp_path / "fixme", "fixme", 8, ledger, dataset=data, **common)
    ok = job_spec(tmp_path / "ok", "ok", 8, ledger, **common)
    assert main(["queue", "create", "slurmq", "--max-nodes", "2", "--ledger", ledger]) == 0
    for spec, prio in ((fixme, "1"), (ok, "2")):
        assert (
            main(["queue", "add", "slurmq", str(spec), "--priority", prio, "--hours", "0.05", "--ledger", ledger]) == 0
        )

    good = data.read_bytes()
    frs = []
    for i, at in enumerate(NIGHTS):
        if i == 0:
            data.write_text("not json\n")  # night 1: corrupt, found by the shard stage inside the pipeline
        elif i == 1:
            data.unlink()  # night 2: gone, found when the queue reads the job's spec
        else:
            data.write_bytes(good)  # night 3: fixed
        fr = run_night(deployment, {"queue": "slurmq", "ledger": ledger, "at": at})
        print(f"\nnight {i + 1}: flow run {fr.name} {fr.state.type.value}; subflows {subflow_names(fr.id)}")
        assert fr.state.is_completed(), fr.state.message  # a job's failed night is recorded, not raised
        frs.append(fr)

    with Ledger(ledger) as lg:
        store = QueueStore(lg)
        jobs = {j.name: j for j in store.jobs("slurmq")}
        runs = store.runs("slurmq")
    for r in runs:
        print(
            f"ledger: night {r.night} job {r.job_id} nodes {r.nodes} run {r.run_id} {r.status} -> {r.job_status}, "
            f"{r.steps_done} steps; {r.reason[:160]}"
        )
    fid, oid = jobs["fixme"].id, jobs["ok"].id
    nights = sorted({r.night for r in runs})
    first = {r.job_id: r for r in runs if r.night == nights[0]}
    # night 1: side by side on nodes 0 and 1; fixme's pipeline failed (its corpus) and it is queued again, ok done
    assert (first[fid].nodes, first[fid].status, first[fid].job_status) == ([0], "failed", "queued"), first[fid]
    assert "invalid JSON" in first[fid].reason and first[fid].flow_run_id, first[fid]
    assert subflow_names(frs[0].id)  # the failed pipeline subflow is the night's too
    assert "FAILED" in subflow_names(frs[0].id).values() and "COMPLETED" in subflow_names(frs[0].id).values()
    ok1 = first[oid]
    assert (ok1.nodes, ok1.status, ok1.job_status, ok1.steps_done) == ([1], "completed", "done", 8), ok1
    # night 2: only fixme, planned again; its spec names a file that is gone: failed before any pipeline
    (again,) = [r for r in runs if r.night == nights[1]]
    assert (again.job_id, again.status, again.job_status, again.flow_run_id) == (fid, "failed", "queued", None)
    assert "dataset.path" in again.reason and subflow_names(frs[1].id) == {}, again
    # night 3: planned again, and it completes
    assert [(r.job_id, r.nodes, r.status, r.job_status, r.steps_done) for r in runs if r.night == nights[2]] == [
        (fid, [0], "completed", "done", 8)
    ]
    assert (jobs["fixme"].status, jobs["ok"].status) == ("done", "done")
    # pinned: ok (node 1) got n2 though n1 was idle; fixme (node 0) n1; its failed nights rented nothing
    assert allocations(tmp_path / "ok") == [("#SBATCH --nodelist=n2", "n2")]
    assert allocations(tmp_path / "fixme") == [("#SBATCH --nodelist=n1", "n1")]
