"""Provisioning tasks: acquire + preflight the cluster, and release it (always; idempotent).

The SSH private key named by `cluster.provider.key_secret` is read from a Prefect Secret block here, never in
nightloom/, and handed to the provider in memory (it is not logged, put in artifacts or in errors).
"""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom.provision import get_provider
from nightloom.provision.base import Cluster, Provider, ProvisionError
from nightloom.provision.nccl import nccl_table


def resolve_ssh_key(secret_name: str) -> str:
    """The private key text stored in the Prefect Secret block `secret_name`."""
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(secret_name).get()
    except ValueError as e:
        raise ProvisionError(
            f"cluster.provider.key_secret: Prefect Secret block {secret_name!r} not found ({type(e).__name__})"
        ) from None
    if not isinstance(value, str) or "PRIVATE KEY" not in value:
        raise ProvisionError(f"cluster.provider.key_secret: Secret block {secret_name!r} does not hold a private key")
    return value


def make_provider(spec) -> Provider:
    """The spec's provider; for ssh with `key_secret`, the key comes from the Prefect Secret block."""
    if spec.cluster.provider.kind == "ssh" and spec.cluster.provider.key_secret:
        from nightloom.provision.ssh import SSHProvider

        return SSHProvider(spec, private_key=resolve_ssh_key(spec.cluster.provider.key_secret))
    return get_provider(spec)


def _artifact(cluster: Cluster) -> None:
    from prefect.artifacts import create_table_artifact

    rows = [
        {"node": n.name, "address": n.address, "slots": n.slots, "ready_s": round(n.ready_s or 0.0, 3), "status": "ok"}
        for n in cluster.nodes
    ]
    rows += [
        {"node": name, "address": "", "slots": 0, "ready_s": 0.0, "status": f"excluded: {why}"}
        for name, why in cluster.excluded.items()
    ]
    create_table_artifact(
        key="cluster-nodes",
        table=rows,
        description=f"{cluster.provider} cluster {cluster.name}: ready in {cluster.time_to_ready_s:.2f} s",
    )
    nccl = nccl_table(cluster.env)
    if nccl:
        create_table_artifact(key="nccl-env", table=nccl, description="NCCL/IB environment of every rank")


@task(name="provision", cache_policy=NO_CACHE)
def acquire_cluster(provider: Provider) -> Cluster:
    """Acquire nodes, prepare their environment and preflight them before any training money is spent."""
    log = get_run_logger()
    cluster = provider.acquire()
    log.info(
        "cluster %s ready in %.1f s: %s",
        cluster.name,
        cluster.time_to_ready_s,
        ", ".join(f"{n.name}({n.slots}, env {n.ready_s or 0:.2f} s)" for n in cluster.nodes),
    )
    for name, reason in cluster.excluded.items():
        log.warning("node %s excluded: %s", name, reason)
    report = provider.last_report
    if report is not None and report.allreduce_detail:
        log.info("all-reduce: %s", report.allreduce_detail)
    if report is not None and report.outcome == "unknown":
        log.warning("preflight outcome unknown: %s", report.unknown_reason)
    try:
        _artifact(cluster)
    except Exception as e:  # noqa: BLE001 - an artifact must never fail provisioning
        log.warning("could not write the cluster artifact: %s", type(e).__name__)
    return cluster


@task(name="teardown", cache_policy=NO_CACHE)
def release_cluster(provider: Provider, cluster: Cluster | None) -> None:
    """Release every node and process of ours; safe to call twice."""
    if cluster is None:
        get_run_logger().info("nothing to release: no cluster was acquired")
        return
    t0 = time.perf_counter()
    provider.release(cluster)
    get_run_logger().info(
        "released %s: %d node(s), %d rank(s); %.2f s",
        cluster.name,
        len(cluster.nodes),
        cluster.world_size,
        time.perf_counter() - t0,
    )
