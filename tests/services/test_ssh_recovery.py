"""Unattended recovery through the ssh provider: two real sshd nodes (.ci/services.sh), one turns unhealthy.

Node 2's interpreter is a wrapper whose PYTHONPATH holds an (at first empty) folder; the node environment
layers that folder before the real site-packages. Mid-run the test drops a fake `torch` (version 0.0.1-fake)
into it and kills node 2's rank: preflight on that node now fails the torch check, as a broken node image
would, so recovery excludes it, re-plans for 1 rank and finishes on node 1, in the same flow run and
ledger row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.support.recovery import processes_mentioning, recovery_spec, run_under_chaos
from tests.support.ssh import PY, plant_fake_torch

pytestmark = [pytest.mark.services, pytest.mark.timeout(400)]


def ssh_recovery_spec(sshenv, tmp_path: Path, sick_python: str) -> Path:  # noqa: F811
    p = recovery_spec(tmp_path, nodes=2, ranks=1, steps=20)
    data = yaml.safe_load(p.read_text())
    hosts = [
        {
            "host": h,
            "port": port,
            "user": sshenv["user"],
            "gpus": 1,
            "workdir": str(tmp_path / f"node{i}"),
            "python": PY if i == 0 else sick_python,
        }
        for i, (h, port) in enumerate(sshenv["hosts"][:2])
    ]
    data["cluster"].update(
        {
            "provider": "ssh",
            "name": f"ssh-rec-{tmp_path.name}",
            "gpus_per_node": 1,
            "ssh": {
                "hosts": hosts,
                "key_env": "NIGHTLOOM_SSH_KEY_FILE",
                "known_hosts": os.environ["NIGHTLOOM_KNOWN_HOSTS"],
            },
        }
    )
    p.write_text(yaml.safe_dump(data))
    return p


def sick_node_python(tmp_path: Path) -> tuple[Path, Path]:
    """(interpreter wrapper whose PYTHONPATH starts with an at first empty folder, that folder)."""
    slot = tmp_path / "sick-slot"
    slot.mkdir()
    wrapper = tmp_path / "python-node2"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={slot} exec {PY} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, slot


def test_unhealthy_ssh_node_is_excluded_and_the_run_finishes(prefect_backend, sshenv, tmp_path):  # noqa: F811
    from nightloom.ledger import Ledger
    from nightloom.metrics import read_metrics
    from nightloom.spec.load import load_spec

    wrapper, slot = sick_node_python(tmp_path)
    spec_path = ssh_recovery_spec(sshenv, tmp_path, str(wrapper))
    spec = load_spec(spec_path)
    bad = f"{sshenv['hosts'][1][0]}:{sshenv['hosts'][1][1]}"

    chaos, state = run_under_chaos(spec_path, tmp_path / "runs", [(0, 6, 1, lambda: plant_fake_torch(slot))])
    assert chaos.done, "the fault was never injected"
    assert state.is_completed(), state.message
    s = state.result()
    run_dir = Path(s.run_dir)
    assert s.status == "completed" and s.interruptions == 1 and s.world_size == 1

    job1 = json.loads((run_dir / "job-attempt1.json").read_text())
    assert job1["plan"]["dp_shard"] * job1["plan"]["dp_replicate"] == 1
    assert job1["plan"]["micro_batch"] * job1["plan"]["grad_accum"] == spec.train.global_batch

    ms = read_metrics(run_dir / "metrics.jsonl")
    assert [m.step for m in ms] == list(range(1, 21)) and len([m for m in ms if m.gap]) == 1

    with Ledger(spec.ledger.url) as ledger:
        row = ledger.get(s.run_id)
        assert [r.run_id for r in ledger.list_runs()] == [s.run_id]
    assert row.status == "succeeded" and row.interruption_count == 1
    (it,) = row.interruptions
    assert it.kind == "node" and bad in it.detail and "torch: 0.0.1-fake" in it.detail, it.detail
    assert it.recovery_s > 0
    assert not processes_mentioning(str(run_dir))


def test_failed_ssh_node_is_replaced_by_a_spare_host(prefect_backend, sshenv, tmp_path):  # noqa: F811
    """Three hosts, the third `spare: true` (on the first sshd, its own workdir). Node 2 turns unhealthy and is
    killed: the spare is connected, prepared and preflighted, joins, and the run finishes on 2 ranks in the
    layout it started with (no re-plan), in the same flow run and ledger row."""
    from nightloom.ledger import Ledger
    from nightloom.metrics import read_metrics
    from nightloom.spec.load import load_spec

    wrapper, slot = sick_node_python(tmp_path)
    spec_path = ssh_recovery_spec(sshenv, tmp_path, str(wrapper))
    data = yaml.safe_load(spec_path.read_text())
    h, port = sshenv["hosts"][0]
    data["cluster"]["ssh"]["hosts"].append(
        {
            "host": h,
            "port": port,
            "user": sshenv["user"],
            "gpus": 1,
            "workdir": str(tmp_path / "spare"),
            "python": PY,
            "spare": True,
        }
    )
    spec_path.write_text(yaml.safe_dump(data))
    spec = load_spec(spec_path)
    spare = f"{h}:{port}#2"

    chaos, state = run_under_chaos(spec_path, tmp_path / "runs", [(0, 6, 1, lambda: plant_fake_torch(slot))])
    assert chaos.done, "the fault was never injected"
    assert state.is_completed(), state.message
    s = state.result()
    run_dir = Path(s.run_dir)
    assert s.status == "completed" and s.interruptions == 1 and s.world_size == 2
    job0 = json.loads((run_dir / "job-attempt0.json").read_text())
    job1 = json.loads((run_dir / "job-attempt1.json").read_text())
    assert job1["plan"] == job0["plan"] and job1["resume"]
    assert (tmp_path / "spare" / ".nightloom").is_dir()  # the spare was prepared (env + code) before joining

    ms = read_metrics(run_dir / "metrics.jsonl")
    assert [m.step for m in ms] == list(range(1, 21)) and {m.world_size for m in ms} == {2}
    with Ledger(spec.ledger.url) as ledger:
        row = ledger.get(s.run_id)
    assert row.status == "succeeded" and row.interruption_count == 1
    (it,) = row.interruptions
    assert it.kind == "node" and spare in it.detail, it.detail
    assert not processes_mentioning(str(run_dir))
