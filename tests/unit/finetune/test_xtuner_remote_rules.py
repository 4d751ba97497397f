"""XTuner on rented nodes, the pure parts: the catalog GPU a node reports (MFU peak), where node_wrapper.py is
on a node, the node env's JSON line, and a launch a failed node ends (the relaunch rule is test_xtuner_recovery)."""

from __future__ import annotations

import threading

import pytest

from nightloom.finetune.config import XTunerConfigError
from nightloom.finetune.remote import NodeEnv, _parse, catalog_gpu, node_peak, profile_of, wrapper_path
from nightloom.provision.base import Cluster, MergedLaunch, Node


@pytest.mark.parametrize(
    "reported, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H100 PCIe", "h100-80gb"),  # alias h100
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A800-SXM4-80GB", "a800-80gb"),
        ("NVIDIA H800 80GB HBM3", "h800"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA L40S", "l40s"),
        ("h100", "h100-80gb"),
    ],
)
def test_catalog_gpu_of_what_a_node_reports(reported, key):
    assert catalog_gpu(reported) == key


@pytest.mark.parametrize("reported", ["NVIDIA Tesla T4", "NVIDIA A100 16GB", "NVIDIA B200", ""])
def test_unknown_gpu_is_an_error_not_a_missing_mfu(reported):
    with pytest.raises(XTunerConfigError, match="not in the catalog.*no peak FLOP/s"):
        catalog_gpu(reported)


def _env(gpus=()):
    return NodeEnv("n1", "/e/bin/python", "k", "gpu", False, 1.0, {}, tuple(gpus))


def test_node_peak_is_the_catalog_datasheet_of_the_reported_gpu():
    from nightloom.catalog import GPUS

    p = node_peak(_env(["NVIDIA H100 80GB HBM3"]))
    assert p.flops == GPUS["h100-80gb"].peak_flops_bf16 and p.source.startswith("datasheet")
    with pytest.raises(XTunerConfigError, match="reports no GPU"):
        node_peak(_env())
    with pytest.raises(XTunerConfigError, match="Tesla T4"):
        node_peak(_env(["Tesla T4"]))


def _cluster(provider, handle):
    n = Node(name="a", address="127.0.0.1", slots=1)
    return Cluster(provider=provider, name="c", nodes=[n], master_addr="127.0.0.1", master_port=1, handle=handle)


def test_wrapper_path_on_the_nodes():
    assert (
        wrapper_path(_cluster("ssh", {"code_key": "abc"})) == ".nightloom/code/abc/nightloom/finetune/node_wrapper.py"
    )
    assert wrapper_path(_cluster("slurm", {"job_id": "3"})).endswith("/nightloom/finetune/node_wrapper.py")
    assert profile_of("cpu") == "cpu" and profile_of("h100") == "gpu"


def test_node_env_line_parsing():
    assert _parse("n1", 'noise\nNIGHTLOOM_XTUNER_ENV {"ok": true, "python": "/p"}\n')["python"] == "/p"
    bad = _parse("n1", "Traceback\nModuleNotFoundError: x\n")
    assert not bad["ok"] and "ModuleNotFoundError" in bad["error"]


def test_node_result_line_found_after_merged_stderr():
    from nightloom.finetune.base_model import MARK
    from nightloom.finetune.remote import _parse_mark

    out = f'log line without newline{MARK}{{"ok": true, "path": "/c/k"}}\n'
    assert _parse_mark(MARK, out)["path"] == "/c/k"


def test_ranks_sharing_a_nodes_stderr_never_split_each_others_lines(monkeypatch):
    """Two ranks on a node write their notices to the one stderr they share. Python run unbuffered (-u, as the
    launchers' environments have it) makes `print` two writes (text, then newline), which interleaved between
    the ranks ("…applied…applied" and a blank line); `_say` is one write of the whole line, whole on a pipe."""
    import io
    import os
    import subprocess
    import sys

    from nightloom.finetune import node_wrapper

    line = "nightloom: CUDA absent: CPU adaptations applied"
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

    monkeypatch.setattr(sys, "stderr", Recorder())
    node_wrapper._say(line)
    assert writes == [line + "\n"]  # print(line, file=sys.stderr) makes [line, "\n"]
    monkeypatch.undo()
    # and end to end: two unbuffered processes on one pipe
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(node_wrapper.__file__)!r}); import node_wrapper\n"
        f"for _ in range(3000): node_wrapper._say({line!r})"
    )
    read, write = os.pipe()
    ranks = [subprocess.Popen([sys.executable, "-u", "-c", code], stderr=write) for _ in range(2)]
    os.close(write)
    with os.fdopen(read, "rb") as f:
        lines = f.read().decode().splitlines()
    assert [r.wait(timeout=60) for r in ranks] == [0, 0]
    assert lines.count(line) == len(lines) == 6000


def test_a_training_rank_dies_with_its_torchrun_agent(tmp_path):
    """node_wrapper's ranks set PR_SET_PDEATHSIG: the agent SIGKILLed (teardown of its process group) takes
    its rank with it, though torchrun started the rank in a session of its own."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from nightloom.finetune.node_wrapper import __file__ as wrapper

    pid_file = tmp_path / "rank.pid"
    rank = (
        f"import sys, os, time; sys.path.insert(0, {os.path.dirname(wrapper)!r}); "
        "import node_wrapper; node_wrapper.die_with_parent(); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True); time.sleep(60)",
        ],
        env={**os.environ, "LOCAL_RANK": "0"},
    )
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the rank outlived its agent")


class _HeldOpen(MergedLaunch):
    """Node n1 failed (exit 1, its stream ended); n2's torchrun waits at its exit barrier, stream open, until
    it is terminated: what the SSH spare test saw after the gloo abort on one node."""

    def __init__(self):
        super().__init__(2, fail_grace_s=0.3)
        self.terminated = threading.Event()
        for item in ("[n1] terminate called without an active exception", None, "[n2] Saving checkpoint"):
            self._q.put(item)

    def poll(self):
        return {"n1": 1, "n2": 0 if self.terminated.is_set() else None}

    def terminate(self):
        if not self.terminated.is_set():
            self.terminated.set()
            self._q.put(None)


def test_a_failed_node_ends_the_launch_while_another_holds_its_stream_open(tmp_path):
    """The train log is read beside `wait`, so the failed node's grace period ends the launch (before, reading
    every line first waited for the other node's stream: its torchrun exit barrier, 300 s)."""
    from nightloom.finetune.attempts import StepWatch, _launch_once
    from nightloom.finetune.launcher import XTunerLaunchError
    from nightloom.finetune.xtuner_plan import XTunerPlan

    launch = _HeldOpen()

    class _Provider:
        def launch(self, cluster, args, env):
            return launch

    plan = XTunerPlan(
        python="python", env_key="k", profile="cpu", method="lora", merge_lora=False, base_model="b",
        run_dir=str(tmp_path), config_path=str(tmp_path / "config.py"), work_dir=str(tmp_path / "work"),
        processed_dir=str(tmp_path / "p"), log_dir=str(tmp_path / "logs"), world_size=2, total_steps=1,
        tokens_per_step=1, data_files=[], prepare_key="x",
    )  # fmt: skip
    cluster = Cluster(
        provider="ssh", name="c", master_addr="127.0.0.1", master_port=1,
        nodes=[Node(name=n, address="127.0.0.1", slots=1) for n in ("n1", "n2")],
    )  # fmt: skip
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.setdefault("err", pytest.raises(XTunerLaunchError, _launch_once, plan, cluster=cluster,
                                                            provider=_Provider(), resume=False,
                                                            watch=StepWatch(lambda s: None), timeout_s=None)),
        daemon=True,
    )  # fmt: skip
    t.start()
    t.join(timeout=20)
    if t.is_alive():
        launch.terminate()  # let the thread end
        pytest.fail("the launch was not ended after the failed node's grace period")
    assert launch.terminated.is_set() and "exit code 1" in str(box["err"].value)
    log = (tmp_path / "logs" / "train.log").read_text()
    assert "[n1] terminate called" in log and "[n2] Saving checkpoint" in log
