"""The `local` provider (the embedded default): each node is a group of processes on this machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from nightloom.provision.base import (
    Capabilities,
    Check,
    Cluster,
    MergedLaunch,
    Node,
    NodeReport,
    PreflightReport,
    ProvisionError,
    torchrun_argv,
)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the orchestrator dies (Linux), so no rank outlives a
    killed flow process; torchrun then stops its workers."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """TERM the process group, wait, then KILL it; idempotent."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    # the leader may be gone while children linger in the group
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ProcessLaunch(MergedLaunch):
    """One subprocess per node, each in its own process group; output merged line by line."""

    def __init__(self, procs: dict[str, subprocess.Popen], fail_grace_s: float = 30.0):
        super().__init__(len(procs), fail_grace_s)
        self.procs = procs
        self._readers = []
        for name, p in procs.items():
            t = threading.Thread(target=self._pump, args=(name, p), daemon=True)
            t.start()
            self._readers.append(t)

    def _pump(self, name: str, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            self._q.put(f"[{name}] {line.rstrip()}")
        self._q.put(None)

    def terminate(self) -> None:
        for p in self.procs.values():
            kill_group(p)

    def notify(self) -> None:
        """SIGTERM to every node's process group (torchrun and its ranks): the ranks save a checkpoint at their
        next step and exit; torchrun waits for them (its shutdown timeout)."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def poll(self) -> dict[str, int | None]:
        """Exit code per node so far (None: still running); never blocks, never kills."""
        return {n: p.poll() for n, p in self.procs.items()}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]


def unhealthy_dir(spec) -> Path:
    """Test/chaos hook: a file `<storage.root>/.clusters/<cluster.name>/unhealthy/<node>` makes that local
    node fail preflight (as a dead GPU would on a real node), so recovery must exclude it."""
    return Path(spec.storage.root) / ".clusters" / spec.cluster.name / "unhealthy"


class LocalProvider:
    """Nodes are process groups on this machine; rendezvous on 127.0.0.1. `recovery.spare_nodes` extra
    nodes (local-N, local-N+1, ...) replace failed ones in `reacquire`."""

    name = "local"
    capabilities = Capabilities()  # its own preflight: this host's interpreters and port
    last_report: PreflightReport | None = None  # of the last acquire

    def __init__(self, spec):
        self.spec = spec
        self.python = sys.executable
        self._launches: list[ProcessLaunch] = []

    def acquire(self) -> Cluster:
        t0 = time.monotonic()
        c = self.spec.cluster
        # a port the spec names, when free; else (unset, or held) one the OS gives: two local runs never collide
        named = "master_port" in c.model_fields_set and port_is_free(c.master_port)
        port = c.master_port if named else free_port()
        nodes = []
        for i in range(c.nodes):
            n0 = time.monotonic()
            nodes.append(
                Node(
                    name=f"local-{i}",
                    address="127.0.0.1",
                    slots=c.gpus_per_node,
                    python=self.python,
                    workdir=os.getcwd(),
                    ready_s=time.monotonic() - n0,
                )
            )
        cluster = Cluster(
            provider="local",
            name=c.name,
            nodes=nodes,
            master_addr="127.0.0.1",
            master_port=port,
            env={"OMP_NUM_THREADS": "1"},
        )
        report = self.last_report = self.preflight(cluster)
        if report.failed:
            raise ProvisionError("; ".join(f"node {n.node}: {n.reason}" for n in report.failed))
        cluster.time_to_ready_s = time.monotonic() - t0
        return cluster

    def preflight(self, cluster: Cluster) -> PreflightReport:
        """torch importable in the node interpreter, no unhealthy marker (`unhealthy_dir`, the chaos hook), and
        the rendezvous port free. Local nodes share this host, so each distinct interpreter is checked once
        (importing torch costs ~2 CPU-seconds; N nodes on one interpreter would pay it N times for one answer),
        and not at all when it is this process's own interpreter and torch is already imported here (notebooks,
        tests)."""
        reports = []
        torch_checks: dict[str, Check] = {}
        loaded = sys.modules.get("torch")  # this very interpreter has imported torch (still on disk): the answer
        if loaded is not None and getattr(loaded, "__version__", None) and os.path.isfile(loaded.__file__ or ""):
            torch_checks[sys.executable] = Check(name="torch", ok=True, detail=str(loaded.__version__))
        for node in cluster.nodes:
            if node.python not in torch_checks:
                r = subprocess.run(
                    [node.python, "-c", "import torch, sys; print(torch.__version__)"],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                torch_checks[node.python] = Check(
                    name="torch",
                    ok=r.returncode == 0,
                    detail=r.stdout.strip() if r.returncode == 0 else r.stderr.strip()[-300:],
                )
            checks = [torch_checks[node.python].model_copy()]
            marker = unhealthy_dir(self.spec) / node.name
            if marker.exists():
                checks.append(Check(name="health", ok=False, detail=f"marked unhealthy by {marker} (chaos hook)"))
            reports.append(NodeReport(node=node.name, ok=all(c.ok for c in checks), checks=checks))
        port_ok = port_is_free(cluster.master_port)
        if not port_ok:
            reports[0].checks.append(Check(name="port", ok=False, detail=f"port {cluster.master_port} in use"))
            reports[0].ok = False
        return PreflightReport(nodes=reports)

    def reacquire(self, cluster: Cluster, exclude: dict[str, str]) -> Cluster:
        """The cluster without `exclude` (name -> reason), topped up with healthy spare nodes, on a fresh port."""
        c = self.spec.cluster
        keep = [n for n in cluster.nodes if n.name not in exclude]
        excluded = {**cluster.excluded, **exclude}
        used = {n.name for n in cluster.nodes} | set(excluded)
        spares = [f"local-{i}" for i in range(c.nodes, c.nodes + self.spec.recovery.spare_nodes)]
        for name in spares:
            if len(keep) >= c.nodes:
                break
            if name in used:
                continue
            node = Node(
                name=name,
                address="127.0.0.1",
                slots=c.gpus_per_node,
                python=self.python,
                workdir=os.getcwd(),
                ready_s=0.0,
            )
            probe = Cluster(
                provider="local", name=c.name, nodes=[node], master_addr="127.0.0.1", master_port=free_port()
            )
            report = self.preflight(probe)
            if report.failed:
                excluded[name] = report.failed[0].reason
                continue
            keep.append(node)
        return cluster.model_copy(deep=True, update={"nodes": keep, "excluded": excluded, "master_port": free_port()})

    def launch(self, cluster: Cluster, module_args: list[str], env: dict[str, str]) -> ProcessLaunch:
        procs = {}
        full_env = {**os.environ, **cluster.env, **env, "PYTHONUNBUFFERED": "1"}
        for i, node in enumerate(cluster.nodes):
            argv = torchrun_argv(node.python, cluster, i, module_args)
            procs[node.name] = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=_die_with_parent,
                bufsize=1,
                env=full_env,
                start_new_session=True,
            )
        launch = ProcessLaunch(procs, fail_grace_s=float(self.spec.train.collective_timeout_s) + 30)
        self._launches.append(launch)
        return launch

    def release(self, cluster: Cluster) -> None:
        """Kill every process this provider started (idempotent)."""
        for launch in self._launches:
            launch.terminate()
