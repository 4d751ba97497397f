"""`provision --check`: acquire + preflight + release, whatever happens, and a per-node report."""

from __future__ import annotations

import time

from pydantic import Field

from nightloom.provision.base import NodeReport, ProvisionError
from nightloom.provision.nccl import render_nccl_env
from nightloom.records import Record


class CheckResult(Record):
    ok: bool
    provider: str
    error: str | None = None
    nodes: list[NodeReport] = Field(default_factory=list)
    ready_s: dict[str, float] = Field(default_factory=dict)  # node -> environment ready
    excluded: dict[str, str] = Field(default_factory=dict)
    time_to_ready_s: float | None = None
    bus_bandwidth_gbps: float | None = None
    allreduce: str = ""
    preflight: str = "unknown"  # passed | failed | unknown (PreflightReport.outcome; unknown without a report)
    preflight_unknown: str = ""  # why the outcome is unknown
    notes: list[str] = Field(default_factory=list)  # what the provider says about itself (e.g. never run live)
    nccl_env: dict[str, str] = Field(default_factory=dict)
    wall_s: float = 0.0


def check(provider) -> CheckResult:
    """Run acquire (which preflights) and release; failures become `error`, never an exception."""
    t0 = time.monotonic()
    spec = provider.spec
    res = CheckResult(ok=False, provider=provider.name, notes=list(provider.capabilities.notes))
    cluster = None
    try:
        res.nccl_env = render_nccl_env(spec.cluster.nccl)
        cluster = provider.acquire()
        res.ok = True
        res.time_to_ready_s = cluster.time_to_ready_s
        res.ready_s = {n.name: n.ready_s or 0.0 for n in cluster.nodes}
        res.excluded = dict(cluster.excluded)
    except ProvisionError as e:
        res.error = str(e)
    finally:
        if cluster is not None:
            provider.release(cluster)
    report = provider.last_report
    if report is not None:
        res.nodes = report.nodes
        res.bus_bandwidth_gbps = report.bus_bandwidth_gbps
        res.allreduce = report.allreduce_detail
        res.preflight, res.preflight_unknown = report.outcome, report.unknown_reason
    else:
        res.preflight_unknown = "the provider produced no preflight report"
    res.wall_s = time.monotonic() - t0
    return res


def format_check(res: CheckResult) -> str:
    """Human-readable report: one block per node, then the cluster line."""
    out = [f"provider {res.provider}: {'OK' if res.ok else 'FAILED'}"]
    out += [f"  note: {n}" for n in res.notes]
    out.append(f"  preflight: {res.preflight}" + (f" ({res.preflight_unknown})" if res.preflight == "unknown" else ""))
    for n in res.nodes:
        ready = f", env ready in {res.ready_s[n.node]:.2f} s" if n.node in res.ready_s else ""
        out.append(f"  node {n.node}: {'ok' if n.ok else 'FAIL'}{ready}")
        out += [f"    {'✓' if c.ok else '✗'} {c.name}: {c.detail}" for c in n.checks]
    for name, why in res.excluded.items():
        out.append(f"  excluded {name}: {why}")
    if res.allreduce:
        out.append(f"  all-reduce: {res.allreduce}")
    if res.nccl_env:
        out.append("  nccl: " + " ".join(f"{k}={v}" for k, v in sorted(res.nccl_env.items())))
    if res.time_to_ready_s is not None:
        out.append(f"  time to ready: {res.time_to_ready_s:.2f} s")
    if res.error:
        out.append(f"  error: {res.error}")
    return "\n".join(out)
