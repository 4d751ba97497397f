"""XTuner on rented nodes: LoRA over the two real sshd nodes and over Slurm n1+n2 (2 nodes x 1 rank, gloo),
the XTuner env ensured on every node (reused warm through the shared env cache CI fills once), conversion and
merge run on node 0, and teardown leaving no process and no Slurm job.

The nodes are this machine, so "remote" processes are found in /proc by the run folder in their command line.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from nightloom.finetune import EnvError, run_xtuner
from nightloom.finetune.remote import ensure_node_envs
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
        # train.xtuner.python is verified on every node, never built; a bad one names each node
        with pytest.raises(EnvError, match=r"node 127\.0\.0\.1:\d+: FileNotFoundError.*train\.xtuner\.python="):
            ensure_node_envs(p, c, "cpu", python="/nonexistent/python")
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


def _pids(*needles: str, program: str = "") -> list[int]:
    """Live processes whose command line holds every needle (and starts `argv[0] program...` when given)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                cmd = (p / "cmdline").read_bytes()
                if (p / "stat").read_text().split()[2] == "Z":
                    continue
            except OSError:
                continue
            argv = cmd.decode(errors="replace").split("\0")
            if all(n.encode() in cmd for n in needles) and " ".join(argv[1:]).startswith(program):
                out.append(int(p.name))
    return out


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _when_checkpointed(work_dir: Path, action, timeout_s: float = 400) -> threading.Thread:
    """Run `action()` in a thread once the run's first checkpoint is complete (`last_checkpoint` names it)."""

    def go():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (work_dir / "last_checkpoint").is_file():
                action()
                return
            time.sleep(0.1)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_xtuner_unhealthy_ssh_node_mid_run_resumes_on_the_node_left(sshenv, xtuner_env, base_model, shards, tmp_path):
    """Node 2 turns unhealthy after the first checkpoint (a fake torch appears on its path, its torchrun is
    killed): preflight excludes it, the config is re-rendered for 1 rank, and XTuner resumes from its last
    checkpoint on node 1; the interruption is in the result (the flow writes it to the ledger)."""
    from nightloom.provision.ssh import SSHProvider
    from tests.support.ssh import plant_fake_torch

    slot = tmp_path / "sick-slot"
    slot.mkdir()
    sick = tmp_path / "python-node2"
    sick.write_text(f'#!/bin/sh\nPYTHONPATH={slot} exec {sys.executable} "$@"\n')
    sick.chmod(0o755)
    cluster = ssh_cluster(sshenv, tmp_path / "nodes")
    cluster["ssh"]["hosts"][1]["python"] = str(sick)
    cluster["min_nodes"] = 1
    spec = remote_spec(tmp_path, base_model, shards, cluster, steps=60, checkpoint_every=4)
    spec = spec.model_copy(update={"recovery": spec.recovery.model_copy(update={"max_attempts": 1})})
    run_dir = tmp_path / "runs" / "ssh-recover"
    work_dir = run_dir / "xtuner" / "work_dir"
    p = SSHProvider(spec)
    c = p.acquire()
    bad = c.nodes[1].name

    def sicken():
        plant_fake_torch(slot)
        # node 2's torchrun agent and its rank (torchrun starts each worker in a session of its own)
        agents = _pids("--node-rank=1", str(run_dir), program="-m torch.distributed.run")
        for pid in agents + [p for p in _pids(str(run_dir)) if _ppid(p) in agents]:
            os.kill(pid, signal.SIGKILL)

    chaos = _when_checkpointed(work_dir, sicken)
    t0, r = time.monotonic(), None
    try:
        r = run_xtuner(spec, shards, run_dir, cluster=c, provider=p, log=QUIET, convert=False)
    finally:
        p.release(c.union(r.cluster) if r is not None and r.cluster else c)
    chaos.join(timeout=5)
    wall = time.monotonic() - t0
    (ev,) = r.interruptions
    print(f"\nxtuner ssh recovery: wall {wall:.1f} s, recovery_s {ev.recovery_s}, stages {r.stage_s}")
    assert ev.kind == "node" and bad in ev.detail and "torch: 0.0.1-fake" in ev.detail, ev.detail
    assert ev.world_before == 2 and ev.world_after == 1 and ev.recovery_s is not None
    assert [n.name for n in r.cluster.nodes] == [c.nodes[0].name] and bad in r.cluster.excluded
    assert r.steps_done == 60 and r.stopped == "completed"
    from nightloom.finetune.logs import launch_dirs, parse_launch

    first, last = parse_launch(launch_dirs(work_dir)[0]), parse_launch(launch_dirs(work_dir)[-1])
    resumed_at = int(last[0]["step"])
    assert resumed_at % 4 == 1 and 1 < resumed_at < 60, "resumed from scratch, not from a checkpoint"
    assert int(last[-1]["step"]) == 60 and len(launch_dirs(work_dir)) == 2
    steps = read_metrics(r.metrics_path)
    assert [m.step for m in steps] == list(range(1, 61)) and all(math.isfinite(m.loss) for m in steps)
    before = {int(x["step"]): float(x["loss"]) for x in first}
    if resumed_at in before:  # the step redone after the resume, against the same step before the failure
        assert float(last[0]["loss"]) == pytest.approx(before[resumed_at], rel=2e-2), (before, last)
    assert not _pids(str(run_dir)), "a process of the run outlived release"


def test_xtuner_cancel_mid_run_on_slurm_leaves_nothing(slurm, xtuner_env, base_model, shards, tmp_path):
    """Teardown mid-training (what the flow's cancel hook does: a fresh provider releases the recorded
    cluster) cancels the allocation: no Slurm job and no process of the run is left, and the run fails."""
    from nightloom.provision.slurm import SlurmProvider, queued

    cluster = {"provider": "slurm", "slurm": {"partition": os.environ.get("NIGHTLOOM_SLURM_PARTITION", "debug")}}
    spec = remote_spec(tmp_path, base_model, shards, cluster, steps=40, checkpoint_every=2)
    run_dir = tmp_path / "runs" / "slurm-cancel"
    p = SlurmProvider(spec, python=sys.executable)
    c = p.acquire()
    chaos = _when_checkpointed(run_dir / "xtuner" / "work_dir", lambda: SlurmProvider(spec).release(c))
    try:
        with pytest.raises(Exception, match="train failed|not running|did not finish"):
            run_xtuner(spec, shards, run_dir, cluster=c, provider=p, log=QUIET, convert=False)
    finally:
        p.release(c)
    chaos.join(timeout=5)
    assert queued(c.handle["job_id"]) is None
    deadline = time.monotonic() + 20
    while _pids(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _pids(str(run_dir)), "a process of the run outlived the cancellation"
