"""The provider-neutral interface: typed records in and out, typed errors (after SkyPilot's sky/provision).

A provider acquires nodes, prepares their environment, checks them (preflight), launches one command per
node with its rank and rendezvous, streams output, and releases everything, idempotently.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import Field

from nightloom.records import Record

#: providers whose nodes are other machines (XTuner's env and tools run there; the run folder must be shared)
REMOTE_PROVIDERS = ("ssh", "slurm")


class ProvisionError(RuntimeError):
    """Provisioning failed; the message names the node and the reason (never a secret)."""


class PreflightError(ProvisionError):
    """Too few healthy nodes remain for any layout."""


class Node(Record):
    name: str
    address: str
    slots: int  # GPUs, or CPU ranks on `local`
    python: str = "python3"
    workdir: str = "."
    port: int | None = None  # ssh port, when relevant
    user: str | None = None
    ready_s: float | None = None  # time from acquire to environment ready


class Cluster(Record):
    """Nodes ready for training, plus how to rendezvous on them."""

    provider: str
    name: str
    nodes: list[Node]
    master_addr: str
    master_port: int
    env: dict[str, str] = Field(default_factory=dict)  # NCCL etc.; never secrets
    time_to_ready_s: float = 0.0
    excluded: dict[str, str] = Field(default_factory=dict)  # node name -> reason
    handle: dict[str, str] = Field(default_factory=dict)  # provider ids (slurm job id, k8s job name)

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.nodes)

    def union(self, other: Cluster) -> Cluster:
        """`other` plus every node of this cluster it lacks: what teardown must reach after a node swap."""
        names = {n.name for n in other.nodes}
        return other.model_copy(update={"nodes": other.nodes + [n for n in self.nodes if n.name not in names]})

    def without(self, exclude: dict[str, str]) -> Cluster:
        """This cluster minus `exclude` (name -> reason); rendezvous moves to the first node left."""
        nodes = [n for n in self.nodes if n.name not in exclude]
        out = self.model_copy(deep=True, update={"nodes": nodes, "excluded": {**self.excluded, **exclude}})
        if nodes and self.master_addr not in {n.address for n in nodes}:
            out.master_addr = nodes[0].address
        return out


class NodeRun(Record):
    """One command run on one node outside torchrun (env builds, data prep, conversion): exit code and output."""

    node: str
    code: int
    output: str
    seconds: float


class Check(Record):
    name: str
    ok: bool
    detail: str = ""


class NodeReport(Record):
    node: str
    ok: bool
    checks: list[Check] = Field(default_factory=list)

    @property
    def reason(self) -> str:
        return "; ".join(f"{c.name}: {c.detail}" for c in self.checks if not c.ok)


class PreflightReport(Record):
    nodes: list[NodeReport]
    bus_bandwidth_gbps: float | None = None
    allreduce_ok: bool | None = None
    allreduce_detail: str = ""
    unknown: str = ""  # why no verdict could be reached (the provider cannot probe nodes, preflight crashed)

    @property
    def failed(self) -> list[NodeReport]:
        return [n for n in self.nodes if not n.ok]

    @property
    def outcome(self) -> Literal["passed", "failed", "unknown"]:
        """failed: a node or the all-reduce test failed; unknown: no node was checked (an empty report is not a
        healthy one) or `unknown` says why; passed: every node was checked and passed."""
        if self.failed or self.allreduce_ok is False:
            return "failed"
        if self.unknown or not self.nodes:
            return "unknown"
        return "passed"

    @property
    def unknown_reason(self) -> str:
        return self.unknown or ("no node was checked" if not self.nodes else "")


class Launch(Protocol):
    """A running multi-node command."""

    def lines(self) -> Iterator[str]: ...  # merged output of every node, prefixed with the node name
    def wait(self, timeout: float | None = None) -> int: ...  # worst exit code over nodes
    def poll(self) -> dict[str, int | None]: ...  # exit code per node so far (None: running); never blocks
    def terminate(self) -> None: ...  # idempotent; kills every process of ours

    @property
    def pids(self) -> list[int]: ...  # local process-group leaders teardown must kill; [] when remote


def follow(
    launch: Launch,
    on_line: Callable[[str], None],
    timeout: float | None = None,
    *,
    join_s: float = 60.0,
    note: Callable[[str], None] | None = None,
) -> int:
    """`launch.wait(timeout)` while a thread hands each output line to `on_line`. Reading every line first would
    block until the last node's stream ends, which a live node's torchrun holds open at its exit barrier (300 s),
    so neither a failed node's grace period nor `timeout` would apply. An error in `on_line` is raised here; a
    reader still streaming `join_s` after the launch ended is abandoned (it writes nothing more; `note` says so)."""
    stop, failed = threading.Event(), []

    def pump() -> None:
        try:
            for line in launch.lines():
                if stop.is_set():  # a reader outliving its launch must not write into what follows it
                    return
                on_line(line)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            failed.append(e)

    reader = threading.Thread(target=pump, name="launch-output", daemon=True)
    reader.start()
    try:
        code = launch.wait(timeout=timeout)
    finally:
        reader.join(timeout=join_s)
        if reader.is_alive():
            stop.set()
            if note is not None:
                note(f"the launch's output was still streaming {join_s:.0f} s after it ended; its tail is not kept")
    if failed:
        raise failed[0]
    return code


class MergedLaunch:
    """What every provider's launch shares: node output merged through one queue (a `None` marks the end of a
    node's stream), and `wait` = the worst exit code, where a failed node gives the others `fail_grace_s`
    to fail too (a dead peer makes them exit at their collective timeout) before everything is killed."""

    def __init__(self, n_nodes: int, fail_grace_s: float):
        self.n_nodes, self.fail_grace_s = n_nodes, fail_grace_s
        self._q: queue.Queue[str | None] = queue.Queue()

    @property
    def pids(self) -> list[int]:
        """Local process groups of this launch (none: the processes run on remote nodes)."""
        return []

    def poll(self) -> dict[str, int | None]:
        raise NotImplementedError

    def terminate(self) -> None:
        raise NotImplementedError

    def lines(self) -> Iterator[str]:
        done = 0
        while done < self.n_nodes:
            item = self._q.get()
            if item is None:
                done += 1
            else:
                yield item

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        failed_at = None
        while True:
            codes = list(self.poll().values())
            if all(c is not None for c in codes):
                return max(codes, key=abs)  # non-zero wins
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.fail_grace_s:
                self.terminate()
            if deadline is not None and time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(f"launch did not finish within {timeout} s")
            time.sleep(0.2)


@dataclass(frozen=True)
class Capabilities:
    """What a provider declares about itself, read by callers instead of probing the provider with getattr."""

    #: preflight runs the node agent on every node, then the all-reduce test over the healthy ones: the one driver
    #: nightloom.provision.preflight.agent_preflight over the provider's `probe_nodes` (ssh, slurm)
    agent_preflight: bool = False
    #: the nodes are other machines (REMOTE_PROVIDERS: XTuner's env and tools run there; the run folder is shared)
    remote_nodes: bool = False
    #: what `provision --check` prints about the provider (e.g. that it never ran against a live cluster)
    notes: tuple[str, ...] = ()


class Provider(Protocol):
    """Every provider has all of these; callers never probe with getattr."""

    name: str
    capabilities: Capabilities
    last_report: PreflightReport | None  # the preflight report of the last acquire (None before, or not run)

    def acquire(self) -> Cluster: ...
    def preflight(self, cluster: Cluster) -> PreflightReport: ...
    def launch(self, cluster: Cluster, module_args: list[str], env: dict[str, str]) -> Launch: ...
    def release(self, cluster: Cluster) -> None: ...

    def reacquire(self, cluster: Cluster, exclude: dict[str, str]) -> Cluster:
        """Recovery: the nodes to relaunch on, without `exclude` (name -> reason), with any spare the
        provider can add; `cluster.without(exclude)` where it has no spares."""
        ...


class NodeShell(Protocol):
    """Providers whose nodes run one command each on request (ssh, slurm): `run_on` runs `argv` in the node's
    workdir with the orchestrator's code importable, recorded so that `release` kills it when it is left running."""

    def run_on(
        self, cluster: Cluster, node: Node, argv: list[str], env: dict[str, str], timeout_s: float = 3600.0
    ) -> NodeRun: ...


def torchrun_argv(python: str, cluster: Cluster, node_rank: int, module_args: list[str]) -> list[str]:
    """The torchrun command line for one node (static rendezvous on the first node)."""
    node = cluster.nodes[node_rank]
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(cluster.nodes)}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={node.slots}",
        f"--master-addr={cluster.master_addr}",
        f"--master-port={cluster.master_port}",
        *module_args,
    ]
