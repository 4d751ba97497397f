"""Provisioning logic without services: shell quoting run through a real shell, preflight judgement, env keys."""

import json
import subprocess
import sys

import pytest

from nightloom.provision.base import Check, Cluster, Node, NodeReport, PreflightError, PreflightReport, ProvisionError
from nightloom.provision.preflight import (
    Expect,
    agent_source,
    apply_preflight,
    baseline_busbw,
    busbw_allreduce,
    clock_skew,
    env_key,
    evaluate,
    failure_summary,
    parse_agent_output,
)
from nightloom.provision.shell import PGID_MARK, session_command

NASTY = ["; rm -rf /tmp/nl-canary", "$(touch {p}/pwn1)", "`touch {p}/pwn2`", "a'b\"c", "$HOME", "x\ny", "*"]


def test_session_command_carries_metacharacters_literally(tmp_path):
    (tmp_path / "nl-canary").mkdir()
    values = [v.format(p=tmp_path) for v in NASTY]
    workdir = tmp_path / "dir; touch pwn3 #"
    workdir.mkdir()
    pid_file = tmp_path / "x.pgid"
    line = session_command(
        str(workdir),
        [
            sys.executable,
            "-c",
            "import sys, os, json; print(json.dumps([os.getcwd(), os.environ['V'], *sys.argv[1:]]))",
            *values,
        ],
        env={"V": values[1]},
        pgid_file=str(pid_file),
    )
    r = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()[0], r.stdout.splitlines()[-1]
    assert first.startswith(PGID_MARK) and int(first.split()[1]) == int(pid_file.read_text())
    cwd, env_v, *argv = json.loads(second)
    assert cwd == str(workdir) and env_v == values[1] and argv == values
    assert (tmp_path / "nl-canary").is_dir()
    assert not any((tmp_path / f).exists() for f in ("pwn1", "pwn2")) and not (workdir / "pwn3").exists()


def test_bad_env_name_rejected():
    with pytest.raises(ProvisionError, match="not a valid identifier"):
        session_command("/tmp", ["true"], env={"A;B": "1"})


def test_env_key_depends_on_requirements_and_refuses_torch():
    assert env_key("/usr/bin/python3", ["a==1", "b==2"]) == env_key("/usr/bin/python3", ["b==2", "a==1"])
    assert env_key("/usr/bin/python3", ["a==1"]) != env_key("/usr/bin/python3", ["a==2"])
    assert env_key("/usr/bin/python3", []) != env_key("/opt/py/bin/python", [])
    with pytest.raises(ProvisionError, match="torch comes from the node"):
        env_key("python3", ["torch==2.0.0"])


@pytest.mark.slow
def test_node_agent_prepare_is_warm_the_second_time_and_probe_reports(tmp_path):
    def agent(cmd, args):
        r = subprocess.run(
            [sys.executable, "-c", agent_source(), cmd, json.dumps(args)], capture_output=True, text=True, timeout=120
        )
        return parse_agent_output("local", r.stdout + r.stderr)

    args = {"workdir": str(tmp_path), "key": "k1", "requirements": []}
    cold, warm = agent("prepare", args), agent("prepare", args)
    assert (cold["warm"], warm["warm"]) == (False, True) and cold["python"] == warm["python"]
    r = subprocess.run(
        [cold["python"], "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, timeout=120
    )
    import torch

    assert r.stdout.strip() == torch.__version__  # the layered env sees the base interpreter's torch
    probe = agent("probe", {"workdir": str(tmp_path)})
    assert probe["torch"] == torch.__version__ and probe["free_disk_gib"] > 0


def test_parse_agent_output_names_the_node():
    with pytest.raises(ProvisionError, match="node n7: .*no result"):
        parse_agent_output("n7", "bash: python9: command not found\n")
    with pytest.raises(ProvisionError, match="node n7: OSError: boom"):
        parse_agent_output("n7", 'NIGHTLOOM_JSON {"ok": false, "error": "OSError: boom"}\n')


def _probe(**kw):
    p = {
        "python": "3.11.7",
        "torch": "2.13.0",
        "gpus": None,
        "cuda_devices": 0,
        "free_disk_gib": 50.0,
        "time_unix": 1000.0,
    }
    p.update(kw)
    return p


EXP = Expect(python="3.11", torch="2.13.0", gpu_type="cpu", gpus=1, min_free_disk_gib=10)


@pytest.mark.parametrize(
    "kw,failing",
    [
        ({}, set()),
        ({"torch": "2.1.0"}, {"torch"}),
        ({"torch": None, "torch_error": "ModuleNotFoundError"}, {"torch"}),
        ({"python": "3.10.1"}, {"python"}),
        ({"free_disk_gib": 2.0}, {"disk"}),
        ({"time_unix": 1010.0}, {"clock"}),
    ],
)
def test_evaluate(kw, failing):
    r = evaluate("n1", _probe(**kw), EXP, 999.0, 1001.0)
    assert {c.name for c in r.checks if not c.ok} == failing and r.ok == (not failing)


def test_gpu_checks_model_count_driver():
    exp = Expect(python="3.11", torch="2.13.0", gpu_type="h100-80gb", gpus=2, min_free_disk_gib=0)
    h100 = {"name": "NVIDIA H100 80GB HBM3", "driver": "550.54", "memory_mib": "81559"}
    a100 = {"name": "NVIDIA A100-SXM4-80GB", "driver": "550.54", "memory_mib": "81559"}
    assert evaluate("n", _probe(gpus=[h100, h100], cuda_devices=2), exp, 999, 1001).ok
    bad = evaluate("n", _probe(gpus=[h100, a100], cuda_devices=2), exp, 999, 1001)
    assert not bad.ok and "wrong model" in bad.reason and "550.54" in bad.reason
    assert "nvidia-smi not found" in evaluate("n", _probe(), exp, 999, 1001).reason


def test_clock_skew_is_zero_inside_the_round_trip():
    assert clock_skew(5.0, 4.0, 6.0) == 0.0 and clock_skew(9.0, 4.0, 6.0) == 3.0 and clock_skew(1.0, 4.0, 6.0) == -3.0


def test_busbw_formula_and_baselines():
    assert busbw_allreduce(10.0, 2) == 10.0 and busbw_allreduce(8.0, 8) == 14.0 and busbw_allreduce(3.0, 1) == 3.0
    from nightloom.catalog import GPUS

    assert baseline_busbw("h100-80gb") == 0.25 * GPUS["h100-80gb"].inter_node_bw and baseline_busbw("cpu") > 0


def _cluster(n):
    nodes = [Node(name=f"n{i}", address=f"10.0.0.{i}", slots=1) for i in range(n)]
    return Cluster(provider="x", name="c", nodes=nodes, master_addr="10.0.0.0", master_port=29500)


def test_apply_preflight_excludes_and_stops_when_too_few():
    bad = NodeReport(node="n0", ok=False, checks=[Check(name="torch", ok=False, detail="2.1.0 (expected 2.13.0)")])
    report = PreflightReport(nodes=[bad, NodeReport(node="n1", ok=True), NodeReport(node="n2", ok=True)])
    c = apply_preflight(_cluster(3), report, min_nodes=2)
    assert [n.name for n in c.nodes] == ["n1", "n2"] and c.master_addr == "10.0.0.1"
    assert c.excluded == {"n0": "torch: 2.1.0 (expected 2.13.0)"}
    with pytest.raises(PreflightError, match=r"only 2 healthy node\(s\) left, need at least 3: node n0: torch"):
        apply_preflight(_cluster(3), report, min_nodes=3)


def test_a_failed_all_reduce_names_the_cause_before_another_nodes_stack_trace():
    """n1 said why in one line (EADDRINUSE); n2 then printed 40 C++ frames and was terminated: the detail leads with
    n1's cause and the launcher's error lines, not with the frames (a CI failure once showed only those)."""
    frames = [f"[n2] frame #{i}: <unknown function> + 0x{i:x} (0x7f in libtorch_cpu.so)" for i in range(41)]
    lines = [
        "[n2] [W1202 00:59:41 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host n1:29540",
        "[n2] Exception raised from ping at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/TCPStore.cpp:427",
        *frames[:20],
        "[n1] Traceback (most recent call last):",
        '[n1]   File "run.py", line 1032, in <module>',
        "[n1] torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
        "address. port: 29540, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
        *frames[20:],
        "[n2] ",
        "[slurm] srun: error: n1: task 0: Exited with exit code 1",
        "[slurm] srun: launch/slurm: _step_signal: Terminating StepId=1.4",
        "[slurm] srun: error: n2: task 1: Terminated",
        "[slurm] srun: Force Terminated StepId=1.4",
    ]
    parts = failure_summary(lines).split(" | ")
    assert "EADDRINUSE" in parts[0] and parts[0].startswith("[n1] torch.distributed.DistNetworkError")
    assert parts[1:3] == [
        "[slurm] srun: error: n1: task 0: Exited with exit code 1",
        "[slurm] srun: error: n2: task 1: Terminated",
    ]
    assert parts[-1] == "[slurm] srun: Force Terminated StepId=1.4" and not any("frame #" in p for p in parts)
    assert failure_summary(["x" * 1000]) == "x" * 299 + "…" and failure_summary([" ", ""]) == ""
    leaked = failure_summary(["[n1] RuntimeError: bad rendezvous token=s3cr3t-abc", "HF_TOKEN=hf_xyz exited 1"])
    assert "s3cr3t" not in leaked and "hf_xyz" not in leaked and "token=***" in leaked
