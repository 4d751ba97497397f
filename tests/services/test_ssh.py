"""The ssh provider against two real sshd on 127.0.0.1 (.ci/services.sh start; env from `services.sh env`).

The 2-node × 1-rank torchrun here runs the all-reduce module (nightloom.provision.allreduce), which is also
the preflight's cross-node test; the trainer itself is exercised by the pipeline tests on `local`.
Remote processes are killed by their recorded process group (works for root logins, unlike SSH signals).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import pytest

from nightloom.provision.base import PreflightError, ProvisionError
from nightloom.provision.ssh import SSHProvider
from tests.support.ssh import make_spec, ours_running

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]
PY = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python")


def test_two_nodes_cold_then_warm_torchrun_and_release(sshenv, tmp_path):
    """acquire (cold, then warm) → preflight all-reduce → 2-node torchrun with shell metacharacters → release."""
    workdir = tmp_path / "work; touch PWNED #"  # carried literally: the folder is created with this name
    spec = make_spec(sshenv, workdir)
    timings = {}
    for phase in ("cold", "warm"):
        p = SSHProvider(spec)
        c = p.acquire()
        timings[phase] = (c.time_to_ready_s, [round(n.ready_s, 2) for n in c.nodes])
        assert len(c.nodes) == 2 and not c.excluded and all(n.ready_s > 0 for n in c.nodes)
        p.release(c)
    print(f"\nssh time to ready (total s, per-node env s): {timings}")
    envs = list((workdir / ".nightloom" / "envs").iterdir())
    assert len(envs) == 1 and (envs[0] / "ready.json").is_file()  # one env, reused warm
    assert not (tmp_path / "PWNED").exists() and workdir.is_dir()

    p = SSHProvider(spec)
    c = p.acquire()
    tag = f"nl{uuid.uuid4().hex[:8]}"
    weird = f"{tag};$(touch {tmp_path}/pwn1)`touch {tmp_path}/pwn2`'\""
    launch = p.launch(c, ["-m", "nightloom.provision.allreduce", "--hold-s", "120", "--tag", weird], {"X": "$(id)"})
    seen, t0 = [], time.monotonic()
    for line in launch.lines():
        seen.append(line)
        if sum("tag=" in s for s in seen) == 2 and any("NIGHTLOOM_ALLREDUCE" in s for s in seen):
            break
        assert time.monotonic() - t0 < 120, seen
    assert {s.split("]")[0] + "]" for s in seen if "tag=" in s} == {f"[{n.name}]" for n in c.nodes}
    assert all(s.endswith(f"tag={weird}") for s in seen if "tag=" in s), seen  # carried literally
    assert ours_running(tag), "the remote torchrun should be running now"
    # teardown from a FRESH provider (as the flow's crash/cancel hook does): kills the recorded process groups
    SSHProvider(spec).release(c)
    deadline = time.monotonic() + 20
    while ours_running(tag) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not ours_running(tag)
    assert launch.wait(timeout=30) != 0
    p.release(c)
    p.release(c)  # idempotent
    assert not (tmp_path / "pwn1").exists() and not (tmp_path / "pwn2").exists()


def test_wrong_torch_on_one_node_is_excluded(sshenv, tmp_path):
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("__version__ = '0.0.1-fake'\n")
    wrapper = tmp_path / "python-fake-torch"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={fake} exec {PY} "$@"\n')
    wrapper.chmod(0o755)
    spec = make_spec(sshenv, tmp_path / "w", min_nodes=1, pythons={1: str(wrapper)})
    p = SSHProvider(spec)
    c = p.acquire()
    try:
        bad = f"{sshenv['hosts'][1][0]}:{sshenv['hosts'][1][1]}"
        assert [n.name for n in c.nodes] != [bad] and len(c.nodes) == 1
        assert "torch: 0.0.1-fake" in c.excluded[bad], c.excluded
    finally:
        p.release(c)
    with pytest.raises(PreflightError, match=rf"need at least 2: node {bad}: torch: 0.0.1-fake \(expected"):
        SSHProvider(make_spec(sshenv, tmp_path / "w", pythons={1: str(wrapper)})).acquire()


def test_run_folder_not_shared_with_a_node_is_refused_naming_it(sshenv, tmp_path):
    """Node 2's interpreter gets a private (tmpfs) view of the run folder, as a machine without the mount would:
    the check after acquire names node 2 alone, and leaves no probe file behind. Node 1 alone passes."""
    import subprocess

    from nightloom.provision.shared_folder import check_shared_folder

    runs = tmp_path / "runs"
    runs.mkdir()
    if subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("unshare -m is not permitted here: no way to give one node a private view of a folder")
    wrapper = tmp_path / "python-own-disk"  # node 2's interpreter, run where an empty folder sits at `runs`
    wrapper.write_text(f'#!/bin/sh\nexec unshare -m sh -c \'mount -t tmpfs none {runs} && exec {PY} "$@"\' sh "$@"\n')
    wrapper.chmod(0o755)
    p = SSHProvider(make_spec(sshenv, tmp_path / "w"))
    acquired = p.acquire()
    nodes = [acquired.nodes[0], acquired.nodes[1].model_copy(update={"python": str(wrapper)})]
    c = acquired.model_copy(update={"nodes": nodes})
    try:
        good, bad = c.nodes[0].name, c.nodes[1].name
        with pytest.raises(
            ProvisionError, match=re.escape(f"storage.root: the run folder {runs}/r1 is not the same folder")
        ) as e:
            check_shared_folder(p, c, runs / "r1")
        assert f"{bad} (FileNotFoundError" in str(e.value) and good not in str(e.value), str(e.value)
        assert list((runs / "r1").iterdir()) == []  # the probe is removed
        check_shared_folder(p, c.model_copy(update={"nodes": c.nodes[:1]}), runs / "r1")
    finally:
        p.release(c)


def test_bad_inputs_name_the_node(sshenv, tmp_path):
    import asyncssh

    (h, p) = sshenv["hosts"][0]
    with pytest.raises(ProvisionError, match=rf"node {h}:1: unreachable"):
        SSHProvider(make_spec(sshenv, tmp_path, hosts=[(h, p), (h, 1)])).acquire()
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    with pytest.raises(ProvisionError, match=rf"node {h}:{p}: host key not verifiable"):
        SSHProvider(make_spec(sshenv, tmp_path, known_hosts=str(empty))).acquire()
    other = tmp_path / "other_key"
    other.write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    os.environ["NL_TEST_OTHER_KEY"] = str(other)
    try:
        with pytest.raises(ProvisionError, match=rf"node {h}:{p}: authentication failed") as e:
            SSHProvider(make_spec(sshenv, tmp_path, key_env="NL_TEST_OTHER_KEY")).acquire()
        assert "PRIVATE KEY" not in str(e.value)
    finally:
        del os.environ["NL_TEST_OTHER_KEY"]
    with pytest.raises(ProvisionError, match="too few nodes"):
        SSHProvider(make_spec(sshenv, tmp_path, nodes=3)).acquire()
    with pytest.raises(ProvisionError, match=r"interpreter '/nonexistent/python' not found"):
        SSHProvider(make_spec(sshenv, tmp_path, python="/nonexistent/python")).acquire()
    with pytest.raises(ProvisionError, match="known_hosts: file not found"):
        SSHProvider(make_spec(sshenv, tmp_path, known_hosts=str(tmp_path / "nope"))).acquire()
