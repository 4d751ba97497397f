"""`nightloom ui` (what `make ui` runs): a Prefect server on 127.0.0.1 with telemetry off, the local-pool work pool,
every deployment of prefect.yaml and a worker, the URL printed; SIGINT (Ctrl-C) stops all of them. It starts its
own server on a free port, so it needs no service from .ci/services.sh."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.services


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def test_ui_brings_up_server_pool_deployments_worker_and_ctrl_c_stops_them(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "ui", "--port", str(port), "--home", str(tmp_path / "home")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any(x.startswith("Prefect UI:") for x in seen):
            assert proc.poll() is None, "nightloom ui exited:\n" + "".join(seen)
            assert time.monotonic() < deadline, "no URL after 300 s:\n" + "".join(seen)
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        assert f"Prefect UI: http://127.0.0.1:{port}\n" in seen
        api = f"http://127.0.0.1:{port}/api"
        for name in ("training-pipeline/nightly", "training-pipeline/on-demand", "shard-dataset/shard-only"):
            assert get(f"{api}/deployments/name/{name}")["work_pool_name"] == "local-pool", name
        deadline = time.monotonic() + 60
        while not post(f"{api}/work_pools/local-pool/workers/filter", {}):
            assert time.monotonic() < deadline, "no worker on local-pool after 60 s"
            time.sleep(1)
        started = children(proc.pid)  # the server and the worker
        assert len(started) == 2, started
        for pid in started:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"PREFECT_SERVER_ANALYTICS_ENABLED=false" in env, pid  # telemetry off
            assert f"PREFECT_API_URL={api}".encode() in env, pid

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, "".join(seen)
        assert not [p for p in started if alive(p)], "left running after Ctrl-C"
    finally:
        if proc.poll() is None:
            proc.kill()
