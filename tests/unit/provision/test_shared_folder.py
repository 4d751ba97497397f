"""check_shared_folder's verdicts without a cluster: nodes are this machine through a NodeShell that runs the
command here (the real ssh and slurm paths are in tests/services/test_ssh.py), with the noise real node shells
add after the output (srun notices on stderr), a node that cannot be asked, and one that reads another folder."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nightloom.provision.base import Cluster, Node, NodeRun, ProvisionError
from nightloom.provision.shared_folder import check_shared_folder


class HereShell:
    """run_on = a local subprocess; `noise` is appended to the output as srun appends its stderr notices;
    `down` nodes time out; `elsewhere` nodes see `folder` under another root (their own disk)."""

    def __init__(
        self, noise: str = "", down: tuple[str, ...] = (), elsewhere: dict[str, tuple[str, str]] | None = None
    ):
        self.noise, self.down, self.elsewhere = noise, down, elsewhere or {}

    def run_on(self, cluster, node, argv, env, timeout_s=3600.0) -> NodeRun:
        if node.name in self.down:
            raise subprocess.TimeoutExpired(argv, timeout_s)
        if node.name in self.elsewhere:
            old, new = self.elsewhere[node.name]
            argv = [a.replace(old, new) for a in argv]
        r = subprocess.run(argv, capture_output=True, text=True, check=False)
        return NodeRun(node=node.name, code=r.returncode, output=r.stdout + r.stderr + self.noise, seconds=0.0)


def _cluster(n: int) -> Cluster:
    nodes = [Node(name=f"n{i}", address="127.0.0.1", slots=1, python=sys.executable, workdir="/tmp") for i in range(n)]
    return Cluster(provider="slurm", name="c", nodes=nodes, master_addr="127.0.0.1", master_port=29999)


def test_shared_with_noise_after_passes_and_leaves_no_probe(tmp_path):
    check_shared_folder(HereShell(noise="srun: Step created for StepId=7.3\n"), _cluster(2), tmp_path / "run")
    assert list((tmp_path / "run").iterdir()) == []


def test_every_bad_node_is_named_and_only_provision_error_comes_out(tmp_path):
    other = tmp_path / "other-disk"
    other.mkdir()
    shell = HereShell(down=("n1",), elsewhere={"n2": (str(tmp_path / "run"), str(other))})
    with pytest.raises(ProvisionError) as e:
        check_shared_folder(shell, _cluster(3), tmp_path / "run", field="storage.root")
    msg = str(e.value)
    assert msg.startswith(f"storage.root: the run folder {tmp_path / 'run'} is not the same folder on node(s) ")
    assert "n1 (TimeoutExpired" in msg and "n2 (FileNotFoundError" in msg and "n0 " not in msg, msg
    assert list((tmp_path / "run").iterdir()) == []
