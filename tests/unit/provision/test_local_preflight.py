"""The local provider's preflight: each distinct node interpreter is asked once whether torch imports (and which),
its own interpreter is answered from the torch this process already imported, and a broken one fails its node."""

from __future__ import annotations

import sys

import torch

from nightloom.provision.base import Cluster, Node
from nightloom.provision.local import LocalProvider
from nightloom.spec import ClusterSpec, DatasetSpec, RunSpec, StorageSpec


def _cluster(pythons: list[str]) -> Cluster:
    nodes = [
        Node(name=f"local-{i}", address="127.0.0.1", slots=1, python=py, workdir="/tmp") for i, py in enumerate(pythons)
    ]
    return Cluster(provider="local", name="pf", nodes=nodes, master_addr="127.0.0.1", master_port=29999)


def test_each_interpreter_is_checked_and_a_broken_one_fails_its_node(tmp_path, monkeypatch):
    fake = tmp_path / "python-fake-torch"  # another interpreter: a torch of another version
    fake.write_text("#!/bin/sh\necho 9.9.9-other\n")
    fake.chmod(0o755)
    broken = tmp_path / "python-broken"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n")
    broken.chmod(0o755)
    spec = RunSpec(
        name="pf",
        dataset=DatasetSpec(path=str(tmp_path)),
        cluster=ClusterSpec(nodes=3, gpus_per_node=1, name="pf"),
        storage=StorageSpec(root=str(tmp_path / "runs")),
    )
    from nightloom.provision import local

    real_run, asked = local.subprocess.run, []

    def run(argv, **kw):
        asked.append(argv[0])
        return real_run(argv, **kw)

    monkeypatch.setattr(local.subprocess, "run", run)
    report = LocalProvider(spec).preflight(_cluster([sys.executable, str(fake), str(broken)]))
    assert asked == [str(fake), str(broken)]  # each other interpreter once; its own not asked
    own, other, bad = report.nodes
    assert own.ok and own.checks[0].detail == torch.__version__  # this process's torch: no subprocess asked
    assert other.ok and other.checks[0].detail == "9.9.9-other"
    assert not bad.ok and "No module named torch" in bad.checks[0].detail
    assert [n.node for n in report.failed] == ["local-2"]
