"""Provisioning tasks: acquire + preflight the cluster, and release it (always; idempotent)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom.provision import get_provider
from nightloom.provision.base import Cluster, Provider


@task(name="provision", cache_policy=NO_CACHE)
def acquire_cluster(provider: Provider) -> Cluster:
    """Acquire nodes, prepare their environment and preflight them before any training money is spent."""
    log = get_run_logger()
    cluster = provider.acquire()
    log.info("cluster %s ready in %.1f s: %s", cluster.name, cluster.time_to_ready_s,
             ", ".join(f"{n.name}({n.slots})" for n in cluster.nodes))
    for name, reason in cluster.excluded.items():
        log.warning("node %s excluded: %s", name, reason)
    return cluster


@task(name="teardown", cache_policy=NO_CACHE)
def release_cluster(provider: Provider, cluster: Cluster | None) -> None:
    """Release every node and process of ours; safe to call twice."""
    if cluster is not None:
        provider.release(cluster)


def make_provider(spec) -> Provider:
    return get_provider(spec)
