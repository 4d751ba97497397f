"""Unattended recovery through the slurm provider (real slurmctld + slurmd n1, n2; .ci/services.sh start).

n1 and n2 share this host and one node environment, so the fault is made per node by Slurm's own variable:
the nodes' interpreter (cluster.provider.python) is a test-only wrapper, which gives this test an environment of
its own; mid-run the test adds a .pth to it that, where $SLURMD_NODENAME is n2, puts a folder holding a fake
`torch` first on sys.path, and kills n2's rank. Preflight now fails on n2, so recovery releases the
allocation and asks Slurm for a new one with `--exclude=n2` and `--nodes=1-2`, which gets n1 alone; the run is
re-planned for 1 rank and finishes in the same flow run and ledger row, and nothing is left in the queue.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.recovery import processes_mentioning, recovery_spec, run_under_chaos
from tests.support.ssh import PY, plant_fake_torch

pytestmark = [pytest.mark.services, pytest.mark.timeout(400)]


def test_failed_slurm_node_is_excluded_from_a_new_allocation(prefect_backend, slurm, tmp_path):  # noqa: F811
    from nightloom.ledger import Ledger
    from nightloom.metrics import read_metrics
    from nightloom.spec.load import load_spec

    slot = tmp_path / "sick-slot"
    slot.mkdir()
    wrapper = tmp_path / "python-nodes"
    wrapper.write_text(f'#!/bin/sh\nexec {PY} "$@"\n')
    wrapper.chmod(0o755)
    spec_path = recovery_spec(tmp_path, nodes=2, ranks=1, steps=20)
    data = yaml.safe_load(spec_path.read_text())
    data["cluster"].update(
        {
            "provider": "slurm",
            "name": f"slurm-rec-{tmp_path.name}",
            "gpus_per_node": 1,
            "slurm": {"partition": "debug", "python": str(wrapper), "time_limit": "00:10:00"},
        }
    )
    spec_path.write_text(yaml.safe_dump(data))
    spec = load_spec(spec_path)

    envs: list[Path] = []

    def break_n2() -> None:
        plant_fake_torch(slot)
        (cluster_file,) = (tmp_path / "runs").glob("*/cluster.json")
        env = Path(json.loads(cluster_file.read_text())["nodes"][0]["python"]).parent.parent
        envs.append(env)
        (site,) = env.glob("lib/python3*/site-packages")
        (site / "zz_test_sick_n2.pth").write_text(
            f"import os, sys; os.environ.get('SLURMD_NODENAME') == 'n2' and sys.path.insert(0, {str(slot)!r})\n"
        )

    try:
        chaos, state = run_under_chaos(spec_path, tmp_path / "runs", [(0, 6, 1, break_n2)])
    finally:
        for env in envs:  # this test's own node environment (keyed by the wrapper's path): not left behind
            shutil.rmtree(env, ignore_errors=True)
    assert chaos.done, "the fault was never injected"
    assert state.is_completed(), state.message
    s = state.result()
    run_dir = Path(s.run_dir)
    assert s.status == "completed" and s.interruptions == 1 and s.world_size == 1

    # two allocations: the first on n1+n2, the second asked to exclude n2 and got n1 alone
    scripts = sorted((Path(spec.storage.root) / "slurm").glob("*/allocation.sbatch"), key=lambda p: p.stat().st_mtime)
    assert len(scripts) == 2
    assert "--exclude" not in scripts[0].read_text() and "#SBATCH --nodes=2\n" in scripts[0].read_text()
    second = scripts[1].read_text()
    assert "#SBATCH --exclude=n2\n" in second and "#SBATCH --nodes=1-2\n" in second
    assert (scripts[1].parent / "nodes").read_text().split() == ["n1"]

    job1 = json.loads((run_dir / "job-attempt1.json").read_text())
    assert job1["plan"]["dp_shard"] * job1["plan"]["dp_replicate"] == 1 and job1["resume"]
    ms = read_metrics(run_dir / "metrics.jsonl")
    assert [m.step for m in ms] == list(range(1, 21)) and len([m for m in ms if m.gap]) == 1
    with Ledger(spec.ledger.url) as ledger:
        row = ledger.get(s.run_id)
    assert row.status == "succeeded" and row.interruption_count == 1
    (it,) = row.interruptions
    assert it.kind == "node" and "n2" in it.detail and "torch: 0.0.1-fake" in it.detail, it.detail

    # nothing of ours left in the queue or running
    q = subprocess.run(
        ["squeue", "-h", "-n", f"nightloom-{spec.name}", "-o", "%i %T"], capture_output=True, text=True, check=False
    )
    assert q.stdout.strip() == "", q.stdout
    assert not processes_mentioning(str(run_dir))
