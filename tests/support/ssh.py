"""The two real sshd nodes CI starts (.ci/services.sh): the `sshenv` fixture and a spec for them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nightloom.spec import ClusterSpec, DatasetSpec, RunSpec, SSHHost, SSHSpec
from tests.support.ci import require_binary, skip_or_fail

PY = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python")


@pytest.fixture(scope="module")
def sshenv():
    require_binary("sshd", "/usr/sbin/sshd")
    need = ("NIGHTLOOM_SSH_HOSTS", "NIGHTLOOM_SSH_KEY_FILE", "NIGHTLOOM_KNOWN_HOSTS")
    missing = [k for k in need if not os.environ.get(k)]
    if missing:
        msg = f"{', '.join(missing)} not set: run `.ci/services.sh start` and eval `.ci/services.sh env`"
        skip_or_fail(msg)
    hosts = [(h.split(":")[0], int(h.split(":")[1])) for h in os.environ["NIGHTLOOM_SSH_HOSTS"].split(",")]
    return {"hosts": hosts, "user": os.environ.get("NIGHTLOOM_SSH_USER", "root")}


def make_spec(
    sshenv,
    workdir,
    hosts=None,
    nodes=2,
    python=PY,
    known_hosts=None,
    key_env="NIGHTLOOM_SSH_KEY_FILE",
    min_nodes=None,
    pythons=None,
):
    hosts = hosts or sshenv["hosts"]
    entries = [
        SSHHost(
            host=h, port=p, user=sshenv["user"], gpus=1, python=(pythons or {}).get(i, python), workdir=str(workdir)
        )
        for i, (h, p) in enumerate(hosts)
    ]
    return RunSpec(
        name="ssh-test",
        dataset=DatasetSpec(path="/tmp"),
        cluster=ClusterSpec(
            provider="ssh",
            nodes=nodes,
            gpus_per_node=1,
            master_port=29000 + os.getpid() % 900,
            min_nodes=min_nodes,
            ssh=SSHSpec(hosts=entries, key_env=key_env, known_hosts=known_hosts or os.environ["NIGHTLOOM_KNOWN_HOSTS"]),
        ),
    )


def ours_running(tag: str) -> list[int]:
    """PIDs whose command line holds `tag` (our remote processes: the nodes are this machine)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
                stat = (p / "stat").read_text().split()
            except OSError:
                continue
            if tag.encode() in cmd and stat[2] != "Z" and int(p.name) != os.getpid():
                pids.append(int(p.name))
    return pids


def plant_fake_torch(folder: Path) -> None:
    """A `torch` package reporting version 0.0.1-fake: preflight's torch check fails where it is imported first."""
    (folder / "torch").mkdir()
    (folder / "torch" / "__init__.py").write_text("__version__ = '0.0.1-fake'\n")
