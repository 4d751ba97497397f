"""Preflight, judged on the orchestrator: per-node checks from a node probe, and the cross-node all-reduce.

Bus bandwidth follows nccl-tests (PERFORMANCE.md): for all-reduce busbw = algbw · 2(n−1)/n, n = ranks,
algbw = bytes / time. It is compared with a per-GPU-type baseline (a fraction of the catalog's inter-node
bandwidth per GPU; for `cpu`, a fixed floor for gloo over TCP).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Protocol

from nightloom.attempt import EXCEPTION_LINE, scrub
from nightloom.node_reply import output_tail, read_reply
from nightloom.provision.base import (
    Capabilities,
    Check,
    Cluster,
    Node,
    NodeReport,
    PreflightError,
    PreflightReport,
    ProvisionError,
    follow,
)

JSON_MARK = "NIGHTLOOM_JSON "
ALLREDUCE_MARK = "NIGHTLOOM_ALLREDUCE "
MAX_CLOCK_SKEW_S = 2.0
#: fraction of the catalog inter-node bandwidth a healthy link must reach in the all-reduce test
BASELINE_FRACTION = 0.25
#: gloo on CPU over loopback/TCP: anything below this is a broken link, not a slow one (bytes/s)
CPU_BASELINE_BUSBW = 5e6


def agent_source() -> str:
    """Source of the node agent, sent as `python -c` (it needs nothing but the stdlib on the node)."""
    return (Path(__file__).with_name("node_agent.py")).read_text()


def parse_agent_output(node: str, text: str) -> dict:
    """The agent's JSON line; a clear error naming the node when it is missing or reports a failure."""
    out = read_reply(JSON_MARK, text)
    if out is None:
        raise ProvisionError(f"node {node}: node agent printed no result ({output_tail(text, 3)})")
    if not out.get("ok"):
        raise ProvisionError(f"node {node}: {out.get('error', 'agent failed')}")
    return out


def env_key(base_python: str, requirements: list[str]) -> str:
    """The node environment's key: a hash of its base interpreter and its sorted requirements."""
    for r in requirements:
        if r.split("=")[0].split("<")[0].split(">")[0].strip().lower() == "torch":
            raise ProvisionError(
                f"cluster.env_requirements: {r!r}: torch comes from the node's base image, "
                "it is checked by preflight, never installed"
            )
    blob = json.dumps({"python": base_python, "requirements": sorted(requirements), "layout": 1})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Expect:
    """What every node must match."""

    python: str  # major.minor
    torch: str
    gpu_type: str
    gpus: int
    min_free_disk_gib: float
    max_clock_skew_s: float = MAX_CLOCK_SKEW_S

    @classmethod
    def from_spec(cls, spec, torch_version: str | None = None, python: str | None = None) -> Expect:
        c = spec.cluster
        return cls(
            python=python or "%d.%d" % sys.version_info[:2],
            torch=torch_version or metadata.version("torch"),
            gpu_type=c.gpu_type,
            gpus=c.gpus_per_node,
            min_free_disk_gib=c.min_free_disk_gib,
        )


def _gpu_model_token(gpu_type: str) -> str:
    """'h100-80gb' -> 'H100' (matched against nvidia-smi's name, e.g. 'NVIDIA H100 80GB HBM3')."""
    return gpu_type.split("-")[0].upper()


def clock_skew(node_unix: float, sent_unix: float, received_unix: float) -> float:
    """Lower bound of the node's clock offset (Cristian): 0 when its reading falls inside [sent, received]."""
    if node_unix > received_unix:
        return node_unix - received_unix
    if node_unix < sent_unix:
        return node_unix - sent_unix
    return 0.0


def evaluate(node: str, probe: dict, expect: Expect, sent_unix: float, received_unix: float) -> NodeReport:
    """Per-node checks from one probe result (sent/received: local clock around the probe's round trip)."""
    checks: list[Check] = []
    py = ".".join(probe["python"].split(".")[:2])
    checks.append(
        Check(name="python", ok=py == expect.python, detail=f"{probe['python']} (expected {expect.python}.x)")
    )
    if probe.get("torch") is None:
        checks.append(Check(name="torch", ok=False, detail=f"not importable: {probe.get('torch_error')}"))
    else:
        checks.append(
            Check(name="torch", ok=probe["torch"] == expect.torch, detail=f"{probe['torch']} (expected {expect.torch})")
        )
    gpus = probe.get("gpus")
    if expect.gpu_type == "cpu":
        checks.append(
            Check(name="gpus", ok=True, detail="cpu node" + (f"; nvidia-smi sees {len(gpus)}" if gpus else ""))
        )
    elif gpus is None:
        checks.append(Check(name="gpus", ok=False, detail=probe.get("gpu_error") or "nvidia-smi not found"))
    else:
        token = _gpu_model_token(expect.gpu_type)
        wrong = [g["name"] for g in gpus if token not in g["name"].upper()]
        drivers = sorted({g["driver"] for g in gpus})
        ok = len(gpus) >= expect.gpus and not wrong and probe.get("cuda_devices", 0) >= expect.gpus
        checks.append(
            Check(
                name="gpus",
                ok=ok,
                detail=(
                    f"{len(gpus)} × {gpus[0]['name'] if gpus else '-'} (driver {', '.join(drivers)}); torch sees "
                    f"{probe.get('cuda_devices')}; expected {expect.gpus} × {token}"
                    + (f"; wrong model: {wrong}" if wrong else "")
                ),
            )
        )
    free = probe["free_disk_gib"]
    checks.append(
        Check(
            name="disk",
            ok=free >= expect.min_free_disk_gib,
            detail=f"{free:.1f} GiB free (need {expect.min_free_disk_gib:g})",
        )
    )
    skew = clock_skew(probe["time_unix"], sent_unix, received_unix)
    checks.append(
        Check(
            name="clock",
            ok=abs(skew) <= expect.max_clock_skew_s,
            detail=f"skew {skew:+.3f} s beyond the {received_unix - sent_unix:.2f} s round trip "
            f"(max ±{expect.max_clock_skew_s:g})",
        )
    )
    return NodeReport(node=node, ok=all(c.ok for c in checks), checks=checks)


def busbw_allreduce(algbw: float, n: int) -> float:
    """nccl-tests bus bandwidth of all-reduce: algbw · 2(n−1)/n."""
    return algbw * 2 * (n - 1) / n if n > 1 else algbw


def baseline_busbw(gpu_type: str) -> float:
    """The bus bandwidth (bytes/s) below which the all-reduce test fails for this GPU type."""
    if gpu_type == "cpu":
        return CPU_BASELINE_BUSBW
    from nightloom.catalog import get_gpu

    return BASELINE_FRACTION * get_gpu(gpu_type).inter_node_bw


def parse_allreduce(lines: list[str]) -> dict | None:
    """Rank 0's bandwidth figures in the launcher's output lines (None: the test printed none)."""
    return read_reply(ALLREDUCE_MARK, "\n".join(lines))


_LAUNCHER_ERROR = re.compile(r"\berror: ")  # srun's / torchrun's own "error:" lines


def failure_summary(lines: list[str], causes: int = 3, tail: int = 3, width: int = 300) -> str:
    """The first lines that say why (an exception, a launcher's `error:`), then the last lines: one node's C++ stack
    trace must not push out another node's one-line cause (a fresh-clone CI failure showed only n2's frames while
    n1 had said EADDRINUSE). Secret-looking `name=value`s are masked, as in the attempt monitor's lines."""
    text = [scrub(x.strip()) for x in lines if x.strip()]
    picked = [x for x in text if EXCEPTION_LINE.search(x) or _LAUNCHER_ERROR.search(x)][:causes]
    picked += [x for x in text[-tail:] if x not in picked]
    return " | ".join(x if len(x) <= width else x[: width - 1] + "…" for x in picked)


def run_allreduce(
    provider, cluster: Cluster, gpu_type: str, timeout_s: float = 120.0, size_mib: float = 4.0
) -> tuple[bool, float | None, str]:
    """Launch the all-reduce test on every node through the provider; (ok, busbw GB/s, detail)."""
    args = ["-m", "nightloom.provision.allreduce", "--size-mib", str(size_mib), "--timeout-s", "60"]
    launch = provider.launch(cluster, args, {"OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    try:
        rc = follow(launch, lines.append, timeout=timeout_s, join_s=30)
    except TimeoutError:
        rc = -1
    finally:
        launch.terminate()
    res = parse_allreduce(lines)
    if rc != 0 or res is None:
        return False, None, f"all-reduce test exited {rc}: {failure_summary(lines) or 'no output'}"
    base = baseline_busbw(gpu_type)
    ok = res["busbw"] >= base
    detail = (
        f"{res['world']} ranks, {res['bytes'] / 2**20:.1f} MiB, busbw {res['busbw'] / 1e9:.3f} GB/s "
        f"(algbw {res['algbw'] / 1e9:.3f} GB/s; baseline {base / 1e9:.3f} GB/s for {gpu_type})"
    )
    return ok, res["busbw"] / 1e9, detail


def agent_argv(python: str, command: str, args: dict) -> list[str]:
    """The node agent's command line on a node: `python -c <agent source> COMMAND JSON-ARGS` (probe, prepare)."""
    return [python, "-c", agent_source(), command, json.dumps(args)]


def unreachable(node: str, why: str) -> NodeReport:
    """The report of a node the probe could not reach or whose agent gave no result: it fails `reach`."""
    return NodeReport(node=node, ok=False, checks=[Check(name="reach", ok=False, detail=why)])


class AgentProbing(Protocol):
    """The primitives a provider with `capabilities.agent_preflight` gives the preflight driver."""

    spec: object
    expect: Expect | None

    def probe_nodes(self, cluster: Cluster, expect: Expect) -> list[NodeReport]:
        """Every node's report from the node agent's probe (one that cannot be reached fails `reach`)."""
        ...


def agent_preflight(provider: AgentProbing, cluster: Cluster) -> PreflightReport:
    """The preflight of the providers that run the node agent (ssh, slurm): each node probed and judged against
    `provider.expect` (default: from the spec), then, when at least 2 nodes passed, the all-reduce test over
    them, rendezvous on the first."""
    expect = provider.expect or Expect.from_spec(provider.spec)
    report = PreflightReport(nodes=provider.probe_nodes(cluster, expect))
    failed = {r.node for r in report.failed}
    healthy: list[Node] = [n for n in cluster.nodes if n.name not in failed]
    if len(healthy) >= 2:
        sub = cluster.model_copy(update={"nodes": healthy, "master_addr": healthy[0].address})
        ok, busbw, detail = run_allreduce(provider, sub, provider.spec.cluster.gpu_type)
        report.allreduce_ok, report.bus_bandwidth_gbps, report.allreduce_detail = ok, busbw, detail
    return report


class AgentPreflight:
    """The base of the providers that run the node agent on remote nodes (ssh, slurm): their capabilities, and
    `preflight` as the one driver, `agent_preflight`, over the provider's own `probe_nodes`."""

    capabilities = Capabilities(agent_preflight=True, remote_nodes=True)
    last_report: PreflightReport | None = None  # of the last acquire

    def preflight(self, cluster: Cluster) -> PreflightReport:
        return agent_preflight(self, cluster)


def apply_preflight(cluster: Cluster, report: PreflightReport, min_nodes: int) -> Cluster:
    """Exclude failed nodes (named with their reasons); stop clearly when fewer than `min_nodes` remain."""
    failed = {r.node: r.reason for r in report.failed}
    cluster.excluded.update(failed)
    cluster.nodes = [n for n in cluster.nodes if n.name not in failed]
    if len(cluster.nodes) < min_nodes:
        why = "; ".join(f"node {k}: {v}" for k, v in cluster.excluded.items()) or "no nodes"
        raise PreflightError(f"only {len(cluster.nodes)} healthy node(s) left, need at least {min_nodes}: {why}")
    if report.allreduce_ok is False:
        raise PreflightError(
            f"cross-node all-reduce test failed on {', '.join(n.name for n in cluster.nodes)}: "
            f"{report.allreduce_detail}"
        )
    if cluster.nodes and cluster.master_addr not in {n.address for n in cluster.nodes}:
        cluster.master_addr = cluster.nodes[0].address
    return cluster
