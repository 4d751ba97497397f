"""The slurm provider against a real Slurm (slurmctld + slurmd n1, n2 on 127.0.0.1; .ci/services.sh start)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from nightloom.provision.base import ProvisionError
from nightloom.provision.slurm import SlurmProvider, job_state, queued, render_batch_script
from nightloom.spec import ClusterSpec, DatasetSpec, RunSpec, SlurmSpec, StorageSpec
from tests.support.ssh import PY, ours_running

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]


def make_spec(tmp_path, nodes=2, partition="debug", **slurm):
    return RunSpec(
        name="slurm-test",
        dataset=DatasetSpec(path="/tmp"),
        storage=StorageSpec(root=str(tmp_path)),
        cluster=ClusterSpec(
            provider="slurm",
            nodes=nodes,
            gpus_per_node=1,
            master_port=29000 + os.getpid() % 900 + 1,
            slurm=SlurmSpec(partition=partition, **slurm),
        ),
    )


def test_two_node_torchrun_then_cancel_leaves_nothing(slurm, tmp_path):
    p = SlurmProvider(make_spec(tmp_path), python=PY)
    c = p.acquire()
    job = c.handle["job_id"]
    print(f"\nslurm time to ready: {c.time_to_ready_s:.2f} s, per node {[round(n.ready_s, 2) for n in c.nodes]}")
    try:
        assert [n.name for n in c.nodes] == ["n1", "n2"] and queued(job) == "RUNNING"
        tag = f"nl{uuid.uuid4().hex[:8]}"
        launch = p.launch(c, ["-m", "nightloom.provision.allreduce", "--hold-s", "120", "--tag", f"{tag} $(id)"], {})
        seen, t0 = [], time.monotonic()
        for line in launch.lines():
            seen.append(line)
            if sum(f"tag={tag} $(id)" in s for s in seen) == 2 and any("NIGHTLOOM_ALLREDUCE" in s for s in seen):
                break
            assert time.monotonic() - t0 < 120, seen
        ranks = sorted(s for s in seen if "tag=" in s)
        assert ranks[0].startswith("[n1] rank 0/2") and "node=n1" in ranks[0]
        assert ranks[1].startswith("[n2] rank 1/2") and "node=n2" in ranks[1]
        assert ours_running(tag)
    finally:
        p.release(c)  # cancel mid-run
    assert queued(job) is None
    deadline = time.monotonic() + 20
    while ours_running(tag) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not ours_running(tag)
    assert job_state(job).state.startswith("CANCELLED")
    assert launch.wait(timeout=10) != 0
    p.release(c)  # idempotent


def test_missing_partition_and_too_few_nodes(slurm, tmp_path):
    with pytest.raises(ProvisionError, match=r"partition 'gpu-a100' not found; available: debug"):
        SlurmProvider(make_spec(tmp_path, partition="gpu-a100"), python=PY).acquire()
    with pytest.raises(ProvisionError, match=r"3 nodes requested but partition 'debug' has 2"):
        SlurmProvider(make_spec(tmp_path, nodes=3), python=PY).acquire()


def test_sbatch_options_are_validated(tmp_path):
    with pytest.raises(ProvisionError, match=r"extra_sbatch\[0\]"):
        render_batch_script(make_spec(tmp_path, extra_sbatch=["--comment=x; rm -rf /"]), str(tmp_path))
    text = render_batch_script(make_spec(tmp_path, extra_sbatch=["--mem=1G"]), str(tmp_path / "a b'c"))
    assert "#SBATCH --mem=1G" in text and "state='" in text and "--nodes=2" in text


def test_recovery_allocation_excludes_failed_nodes_and_accepts_fewer(tmp_path):
    spec = make_spec(tmp_path, exclude=["n9"])
    text = render_batch_script(spec, str(tmp_path), avoid=["n2", "bad name;rm"], min_nodes=1)
    assert "#SBATCH --exclude=n9,n2\n" in text and "#SBATCH --nodes=1-2\n" in text and "bad name" not in text
    assert "#SBATCH --nodes=2\n" in render_batch_script(spec, str(tmp_path), avoid=[], min_nodes=None)
