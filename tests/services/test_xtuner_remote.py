"""XTuner on rented nodes: LoRA over the two real sshd nodes and over Slurm n1+n2 (2 nodes x 1 rank, gloo),
the XTuner env ensured on every node (reused warm through the shared env cache CI fills once), conversion and
merge run on node 0, and teardown leaving no process and no Slurm job.

The nodes are this machine, so "remote" processes are found in /proc by the run folder in their command line.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest

from nightloom.finetune import run_xtuner
from nightloom.metrics import read_metrics
from nightloom.spec import RunSpec
from tests.support.ssh import ours_running
from tests.support.xtuner_data import alpaca_rows, make_spec, merged_vs_peft, write_shards

pytestmark = [pytest.mark.services, pytest.mark.timeout(600)]


def QUIET(s):
    return None


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"), alpaca_rows(48))


def remote_spec(tmp: Path, base_model: Path, shards: Path, cluster: dict, **train) -> RunSpec:
    """The local LoRA test's spec (4 steps, global batch 2) on a 2-node cluster of 1 rank each."""
    spec = make_spec(tmp, base_model, shards, method="lora", global_batch=2, **train)
    data = spec.model_dump(mode="json", by_alias=True)
    data["cluster"] = {
        "nodes": 2,
        "gpus_per_node": 1,
        "gpu_type": "cpu",
        "name": f"xt-{tmp.name}",
        "master_port": 21000 + os.getpid() % 4000,
        **cluster,
    }
    return RunSpec.model_validate(data)


def ssh_cluster(sshenv, workdir: Path) -> dict:
    hosts = [
        {"host": h, "port": p, "user": sshenv["user"], "gpus": 1, "python": sys.executable, "workdir": str(workdir)}
        for h, p in sshenv["hosts"][:2]
    ]
    return {
        "provider": "ssh",
        "ssh": {
            "hosts": hosts,
            "key_env": "NIGHTLOOM_SSH_KEY_FILE",
            "known_hosts": os.environ["NIGHTLOOM_KNOWN_HOSTS"],
        },
    }


def check_lora_result(r, run_dir: Path, xtuner_env, base_model: Path, nodes: list[str]) -> None:
    """Trained 4 steps on 2 ranks, metrics in the run folder, merged model == base ⊕ adapter (PEFT)."""
    assert r.steps_done == 4 and r.stopped == "completed" and r.profile == "cpu"
    steps = read_metrics(r.metrics_path)
    assert [m.step for m in steps] == [1, 2, 3, 4] and all(math.isfinite(m.loss) for m in steps)
    assert Path(r.metrics_path).parent == run_dir and Path(r.model_dir).parent == run_dir
    assert sorted(r.node_ready_s) == sorted(nodes) and all(s > 0 for s in r.node_ready_s.values())
    log = (run_dir / "xtuner" / "logs" / "train.log").read_text()
    assert all(f"[{n}] nightloom: CUDA absent" in log for n in nodes)  # a rank on each node
    convert_log = (run_dir / "xtuner" / "logs" / "convert.log").read_text()
    assert f"$ [{nodes[0]}]" in convert_log  # conversion and merge ran on node 0
    d = merged_vs_peft(xtuner_env, base_model, r.adapter_dir, r.model_dir)
    assert d["vs_peft16"] < 1e-6, d  # the merged model is exactly base ⊕ adapter
    assert d["vs_base"] > 1e-3, d  # LoRA changed the model


def test_xtuner_lora_over_two_ssh_nodes(sshenv, xtuner_env, base_model, shards, tmp_path):
    from nightloom.provision.ssh import SSHProvider

    spec = remote_spec(tmp_path, base_model, shards, ssh_cluster(sshenv, tmp_path / "nodes"))
    run_dir = tmp_path / "runs" / "ssh-lora"
    p = SSHProvider(spec)
    c = p.acquire()
    t0 = time.monotonic()
    try:
        r = run_xtuner(spec, shards, run_dir, cluster=c, provider=p, log=QUIET)
    finally:
        p.release(c)
    wall = time.monotonic() - t0
    print(f"\nxtuner over ssh: wall {wall:.1f} s, stages {r.stage_s}, node env ready {r.node_ready_s}")
    check_lora_result(r, run_dir, xtuner_env, base_model, [n.name for n in c.nodes])
    assert not ours_running(str(run_dir)), "a process of the run outlived release"


def test_xtuner_lora_over_slurm_two_nodes(slurm, xtuner_env, base_model, shards, tmp_path):
    from nightloom.provision.slurm import SlurmProvider, queued

    cluster = {"provider": "slurm", "slurm": {"partition": os.environ.get("NIGHTLOOM_SLURM_PARTITION", "debug")}}
    spec = remote_spec(tmp_path, base_model, shards, cluster)
    run_dir = tmp_path / "runs" / "slurm-lora"
    p = SlurmProvider(spec, python=sys.executable)
    c = p.acquire()
    t0 = time.monotonic()
    try:
        r = run_xtuner(spec, shards, run_dir, cluster=c, provider=p, log=QUIET)
    finally:
        p.release(c)
    wall = time.monotonic() - t0
    print(f"\nxtuner over slurm: wall {wall:.1f} s, stages {r.stage_s}, node env ready {r.node_ready_s}")
    check_lora_result(r, run_dir, xtuner_env, base_model, [n.name for n in c.nodes])
    assert queued(c.handle["job_id"]) is None, "the allocation outlived release"
    assert not ours_running(str(run_dir)), "a process of the run outlived release"
