"""Providers declare what they can do (base.Capabilities) instead of being probed with getattr, and the SSH and
Slurm preflight is one driver (preflight.agent_preflight) over each provider's `probe_nodes`."""

from __future__ import annotations

from types import SimpleNamespace

from nightloom.provision import preflight
from nightloom.provision.base import REMOTE_PROVIDERS, Capabilities, Check, Cluster, Node, NodeReport
from nightloom.provision.k8s import UNTESTED_LIVE, KubernetesProvider
from nightloom.provision.local import LocalProvider
from nightloom.provision.slurm import SlurmProvider
from nightloom.provision.ssh import SSHProvider

PROVIDERS = (LocalProvider, SSHProvider, SlurmProvider, KubernetesProvider)


def test_every_provider_declares_its_capabilities():
    for cls in PROVIDERS:
        assert isinstance(cls.capabilities, Capabilities), cls.__name__
    assert {c.name for c in PROVIDERS if c.capabilities.remote_nodes} == set(REMOTE_PROVIDERS)
    assert {c.name for c in PROVIDERS if c.capabilities.agent_preflight} == {"ssh", "slurm"}
    for cls in PROVIDERS:  # the driver's primitive exactly where the capability is declared
        assert hasattr(cls, "probe_nodes") == cls.capabilities.agent_preflight, cls.__name__
    assert KubernetesProvider.capabilities.notes == (UNTESTED_LIVE,)
    assert LocalProvider.capabilities.notes == ()


def _cluster(*names: str) -> Cluster:
    nodes = [Node(name=n, address=f"10.0.0.{i}", slots=1) for i, n in enumerate(names, 1)]
    return Cluster(provider="ssh", name="c", nodes=nodes, master_addr="10.0.0.1", master_port=29500)


class _Prober:
    def __init__(self, bad: set[str]):
        self.bad = bad
        self.spec = SimpleNamespace(cluster=SimpleNamespace(gpu_type="cpu"))
        self.expect = preflight.Expect(python="3.11", torch="2", gpu_type="cpu", gpus=0, min_free_disk_gib=0.0)
        self.seen = None

    def probe_nodes(self, cluster, expect):
        self.seen = expect
        return [
            NodeReport(node=n.name, ok=n.name not in self.bad, checks=[Check(name="reach", ok=n.name not in self.bad)])
            for n in cluster.nodes
        ]


def test_the_driver_probes_every_node_then_all_reduces_over_the_healthy_ones(monkeypatch):
    calls = []

    def fake_allreduce(provider, cluster, gpu_type):
        calls.append((provider, [n.name for n in cluster.nodes], cluster.master_addr, gpu_type))
        return True, 1.5, "2 ranks"

    monkeypatch.setattr(preflight, "run_allreduce", fake_allreduce)
    p = _Prober(bad={"a"})
    report = preflight.agent_preflight(p, _cluster("a", "b", "c"))
    assert p.seen is p.expect
    assert [r.node for r in report.failed] == ["a"]
    assert calls == [(p, ["b", "c"], "10.0.0.2", "cpu")]
    assert (report.allreduce_ok, report.bus_bandwidth_gbps, report.allreduce_detail) == (True, 1.5, "2 ranks")

    calls.clear()
    report = preflight.agent_preflight(_Prober(bad={"a", "b"}), _cluster("a", "b", "c"))
    assert calls == [] and report.allreduce_ok is None and report.outcome == "failed"


def test_ssh_and_slurm_share_the_agent_s_preflight_pieces():
    """One preflight method, one node-agent command line and one unreachable-node report for both providers."""
    import json

    for cls in (SSHProvider, SlurmProvider):
        assert issubclass(cls, preflight.AgentPreflight) and cls.preflight is preflight.AgentPreflight.preflight
    argv = preflight.agent_argv("/usr/bin/python3", "probe", {"workdir": "/w"})
    assert argv[:2] == ["/usr/bin/python3", "-c"] and argv[3:] == ["probe", json.dumps({"workdir": "/w"})]
    assert argv[2] == preflight.agent_source()
    report = preflight.unreachable("n1", "connection refused")
    assert not report.ok and report.reason and "connection refused" in report.reason
    assert [(c.name, c.ok) for c in report.checks] == [("reach", False)]
