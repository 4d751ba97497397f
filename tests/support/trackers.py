"""The trackers as a test reads them back: MLflow's REST API (the CI server, NIGHTLOOM_TEST_MLFLOW_URI), W&B's
offline run files, TensorBoard's event files; and `Outage`, a TCP proxy in front of the MLflow server that a test
takes down (connections refused, open ones cut) and brings back, as a server stopped and restarted looks to its
clients."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.support.ci import in_ci, skip_or_fail


def flow_tracking(experiment: str) -> dict:
    """A flow test's `track` section: MLflow on CI's server (left out on a machine without one; never in CI), W&B
    offline and TensorBoard."""
    uri = os.environ.get("NIGHTLOOM_TEST_MLFLOW_URI")
    if not uri and in_ci():
        pytest.fail("no MLflow server: NIGHTLOOM_TEST_MLFLOW_URI is not set (.ci/services.sh starts one)")
    track: dict = {"wandb": {}, "tensorboard": {}}
    if uri:
        track["mlflow"] = {"tracking_uri": uri, "experiment": experiment}
    return track


def mlflow_uri() -> str:
    uri = os.environ.get("NIGHTLOOM_TEST_MLFLOW_URI")
    if not uri:
        skip_or_fail("no MLflow server: NIGHTLOOM_TEST_MLFLOW_URI is not set (.ci/services.sh starts one)")
    return uri


def mlflow_get(uri: str, path: str, **query) -> dict:
    """One GET of MLflow's REST API (/api/2.0/mlflow/...)."""
    url = f"{uri}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def mlflow_history(uri: str, run_id: str, key: str) -> dict[int, float]:
    """step -> value of one metric of a run (the last value logged at a step)."""
    got = mlflow_get(uri, "metrics/get-history", run_id=run_id, metric_key=key, max_results=25000)
    return {int(m["step"]): float(m["value"]) for m in sorted(got.get("metrics", []), key=lambda m: m["timestamp"])}


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a .wandb file: a 7-byte header (':W&B', magic, version), then LevelDB's log format (32 KiB
    blocks; each record a 7-byte header: CRC32, length, type full/first/middle/last)."""
    data, block, pos = path.read_bytes(), 32768, 7
    out, part = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:  # the block's zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            out.append(part + chunk)
    return out


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """step -> the values logged at it, over every offline run file under run_dir/wandb."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[int, dict] = {}
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for raw in _wandb_records(f):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                out.setdefault(int(items["_step"]), {}).update(items)
    return out


def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


class Outage:
    """A TCP proxy 127.0.0.1:port -> upstream; `down()` closes the listener and cuts open connections (clients get
    'connection refused'), `up()` listens again on the same port."""

    def __init__(self, upstream: str):
        u = urllib.parse.urlsplit(upstream)
        self.target = (u.hostname, u.port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def up(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            ls, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if ls is not None:  # shutdown first: a close alone leaves the accept() blocked in its thread listening
            try:
                ls.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            ls.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
