"""Providers of nodes: local (default), ssh, slurm, kubernetes. SDKs are imported lazily."""

from __future__ import annotations

from nightloom.provision.base import Cluster, Launch, Node, Provider, ProvisionError  # noqa: F401


def get_provider(spec) -> Provider:
    """The provider named by `spec.cluster.provider.kind`."""
    kind = spec.cluster.provider.kind
    if kind == "local":
        from nightloom.provision.local import LocalProvider

        return LocalProvider(spec)
    if kind == "ssh":
        from nightloom.provision.ssh import SSHProvider

        return SSHProvider(spec)
    if kind == "slurm":
        from nightloom.provision.slurm import SlurmProvider

        return SlurmProvider(spec)
    if kind == "kubernetes":
        from nightloom.provision.k8s import KubernetesProvider

        return KubernetesProvider(spec)
    raise ProvisionError(f"cluster.provider.kind: unknown provider {kind!r}")
