"""The `kubernetes` provider: an indexed Job (one pod per node) plus a headless Service for the rendezvous.

Pod i runs torchrun with --node-rank=$(JOB_COMPLETION_INDEX) (Kubernetes expands `$(VAR)` in args from the
container env); the master is pod 0 at JOB-0.SERVICE (indexed Job pods get that hostname/subdomain).
Manifests are plain dicts validated by deserialising into the kubernetes client's models (V1Job,
V1Service). They are applied only when `cluster.provider.kubeconfig` is given. A literal `$(` in a spec
value is escaped to `$$(` so Kubernetes never expands it. The kubernetes SDK is imported lazily.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

from nightloom.provision.base import Capabilities, Cluster, Node, PreflightReport, ProvisionError, torchrun_argv
from nightloom.provision.nccl import render_nccl_env

_DNS = re.compile(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?")
#: said by `provision --check` and docs/providers.md until a test runs the provider against a real cluster
UNTESTED_LIVE = (
    "the kubernetes provider has never run against a live cluster: its tests validate the manifests against "
    "the kubernetes client's models and call a fake API; none applies them to a real cluster"
)
K8S_PREFLIGHT_UNKNOWN = "kubernetes: pods do not exist before launch, so no node was probed (outcome unknown)"


def k8s_name(run_name: str) -> str:
    """A DNS-1123 label from the run name ('My_Run.1' -> 'nightloom-my-run-1')."""
    name = "nightloom-" + re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")
    return name[:52].rstrip("-")


def _lit(v: str) -> str:
    """A value Kubernetes must not expand: `$(X)` → `$$(X)`."""
    return v.replace("$(", "$$(")


def _object(api_version: str, kind: str, name: str, namespace: str, labels: dict, spec: dict) -> dict:
    """A Kubernetes object: its type, its metadata (name, namespace, the run's labels) and `spec`."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": spec,
    }


def render_manifests(
    spec, module_args: list[str], env: dict[str, str] | None = None, python: str = "python"
) -> dict[str, dict]:
    """{'service': ..., 'job': ...} for `spec`; raises ProvisionError naming the field on bad values."""
    c, k = spec.cluster, spec.cluster.provider
    name = k8s_name(spec.name)
    if not _DNS.fullmatch(name):
        raise ProvisionError(f"name: {spec.name!r} gives no valid Kubernetes name ({name!r})")
    if not _DNS.fullmatch(k.namespace):
        raise ProvisionError(f"cluster.provider.namespace: {k.namespace!r} is not a DNS-1123 label")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*(:[A-Za-z0-9._-]+)?(@sha256:[0-9a-f]{64})?", k.image):
        raise ProvisionError(f"cluster.provider.image: {k.image!r} is not an image reference")
    svc = name
    master = f"{name}-0.{svc}"
    nodes = [
        Node(name=f"{name}-{i}", address=f"{name}-{i}.{svc}", slots=c.gpus_per_node, python=python)
        for i in range(c.nodes)
    ]
    cluster = Cluster(provider="kubernetes", name=c.name, nodes=nodes, master_addr=master, master_port=c.master_port)
    argv = torchrun_argv(python, cluster, 0, module_args)
    argv = ["--node-rank=$(JOB_COMPLETION_INDEX)" if a == "--node-rank=0" else _lit(a) for a in argv]
    full_env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **render_nccl_env(c.nccl), **(env or {})}
    for key in full_env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ProvisionError(f"environment variable name {key!r} is not a valid identifier")
    resources: dict = {}
    if c.gpu_type != "cpu":
        resources = {
            "limits": {k.gpu_resource: str(c.gpus_per_node)},
            "requests": {k.gpu_resource: str(c.gpus_per_node)},
        }
    labels = {"app.kubernetes.io/name": "nightloom", "nightloom/run": name}
    service = _object(
        "v1",
        "Service",
        svc,
        k.namespace,
        labels,
        {
            "clusterIP": "None",
            "selector": {"nightloom/run": name},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": c.master_port, "targetPort": c.master_port}],
        },
    )
    job = _object(
        "batch/v1",
        "Job",
        name,
        k.namespace,
        labels,
        {
            "completionMode": "Indexed",
            "completions": c.nodes,
            "parallelism": c.nodes,
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "subdomain": svc,
                    "restartPolicy": "Never",
                    # a deleted or evicted pod's ranks get SIGTERM, then this long to save a checkpoint and stop
                    "terminationGracePeriodSeconds": spec.recovery.preempt_grace_s,
                    "containers": [
                        {
                            "name": "trainer",
                            "image": k.image,
                            "command": [argv[0]],
                            "args": argv[1:],
                            "env": [{"name": key, "value": _lit(v)} for key, v in full_env.items()],
                            "ports": [{"containerPort": c.master_port, "name": "rendezvous"}],
                            "resources": resources,
                        }
                    ],
                },
            },
        },
    )
    return {"service": service, "job": job}


def validate_manifests(manifests: dict[str, dict]) -> dict[str, object]:
    """Deserialise into the client's models (V1Service, V1Job): a missing required field or wrong type raises."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    out = {}
    for key, kind in (("service", "V1Service"), ("job", "V1Job")):
        try:
            out[key] = api._ApiClient__deserialize(manifests[key], kind)  # the client's own model loader
        except (ValueError, TypeError) as e:
            raise ProvisionError(f"kubernetes {kind} manifest invalid: {e}") from None
    return out


class KubernetesLaunch:
    """Pod logs of the Job, merged; terminate deletes the Job (foreground) and the Service."""

    def __init__(self, provider: KubernetesProvider, cluster: Cluster):
        self.provider, self.cluster = provider, cluster

    def lines(self) -> Iterator[str]:
        core = self.provider.core()
        ns, name = self.provider.spec.cluster.provider.namespace, self.cluster.handle["job"]
        pods = core.list_namespaced_pod(ns, label_selector=f"nightloom/run={name}").items
        for pod in pods:
            for line in core.read_namespaced_pod_log(
                pod.metadata.name, ns, follow=True, _preload_content=False
            ).stream():
                yield f"[{pod.metadata.name}] {line.decode(errors='replace').rstrip()}"

    def poll(self) -> dict[str, int | None]:
        """The indexed Job's state for every node: 0 when all completions succeeded, 1 once one pod failed."""
        st = (
            self.provider.batch()
            .read_namespaced_job_status(self.cluster.handle["job"], self.provider.spec.cluster.provider.namespace)
            .status
        )
        rc = 1 if st.failed else (0 if (st.succeeded or 0) >= len(self.cluster.nodes) else None)
        return {n.name: rc for n in self.cluster.nodes}

    def wait(self, timeout: float | None = None) -> int:
        batch = self.provider.batch()
        ns, name = self.provider.spec.cluster.provider.namespace, self.cluster.handle["job"]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = batch.read_namespaced_job_status(name, ns).status
            if st.succeeded and st.succeeded >= len(self.cluster.nodes):
                return 0
            if st.failed:
                return 1
            if deadline is not None and time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(f"kubernetes job {name} did not finish within {timeout} s")
            time.sleep(2)

    def terminate(self) -> None:
        self.provider.release(self.cluster)

    @property
    def pids(self) -> list[int]:
        """No local processes: the pods are the Job's, deleted by terminate/release."""
        return []


class KubernetesProvider:
    """Applies the manifests with the kubernetes client; without `kubeconfig`, acquire refuses and points at
    render_manifests() (to apply them yourself)."""

    name = "kubernetes"
    last_report: PreflightReport | None = None  # of the last acquire
    capabilities = Capabilities(notes=(UNTESTED_LIVE,))  # the note is printed by `provision --check`

    def __init__(self, spec):
        self.spec = spec
        self._client_ready = False
        self.last_report: PreflightReport | None = None

    def _config(self):
        kc = self.spec.cluster.provider.kubeconfig
        if not kc:
            raise ProvisionError(
                "cluster.provider.kubeconfig: not set; render_manifests() gives the manifests "
                "to apply yourself (kubectl apply -f)"
            )
        if not self._client_ready:
            from kubernetes import config

            config.load_kube_config(config_file=kc)
            self._client_ready = True

    def core(self):
        from kubernetes import client

        self._config()
        return client.CoreV1Api()

    def batch(self):
        from kubernetes import client

        self._config()
        return client.BatchV1Api()

    def acquire(self) -> Cluster:
        """Nothing runs until launch (the pods are the nodes); check the API answers and return the shape."""
        t0 = time.monotonic()
        self.core().list_namespaced_pod(self.spec.cluster.provider.namespace, limit=1)
        m = render_manifests(self.spec, [])
        name = m["job"]["metadata"]["name"]
        c = self.spec.cluster
        nodes = [
            Node(name=f"{name}-{i}", address=f"{name}-{i}.{name}", slots=c.gpus_per_node, python="python")
            for i in range(c.nodes)
        ]
        cluster = Cluster(
            provider="kubernetes",
            name=c.name,
            nodes=nodes,
            master_addr=f"{name}-0.{name}",
            master_port=c.master_port,
            env=render_nccl_env(c.nccl),
            handle={"job": name},
            time_to_ready_s=time.monotonic() - t0,
        )
        self.last_report = self.preflight(cluster)
        return cluster

    def preflight(self, cluster: Cluster) -> PreflightReport:
        """No pod exists before launch (the image pins python/torch), so nothing is probed: the outcome is
        "unknown", never "passed"."""
        return PreflightReport(nodes=[], unknown=K8S_PREFLIGHT_UNKNOWN)

    def launch(self, cluster: Cluster, module_args: list[str], env: dict[str, str]) -> KubernetesLaunch:
        m = render_manifests(self.spec, module_args, env)
        validate_manifests(m)
        ns = self.spec.cluster.provider.namespace
        self.core().create_namespaced_service(ns, m["service"])
        self.batch().create_namespaced_job(ns, m["job"])
        return KubernetesLaunch(self, cluster)

    def reacquire(self, cluster: Cluster, exclude: dict[str, str]) -> Cluster:
        """Recovery: the cluster without `exclude` (no spares on Kubernetes yet). Preflight never names a failed
        pod, so recovery excludes nothing here, and launch renders a fresh Job of the spec's size."""
        return cluster.without(exclude)

    def release(self, cluster: Cluster) -> None:
        """Delete the Job (foreground: its pods first) and the Service; 404 means already gone (idempotent)."""
        if not self.spec.cluster.provider.kubeconfig or "job" not in cluster.handle:
            return
        from kubernetes.client.exceptions import ApiException

        ns, name = self.spec.cluster.provider.namespace, cluster.handle["job"]
        for delete in (
            lambda: self.batch().delete_namespaced_job(name, ns, propagation_policy="Foreground"),
            lambda: self.core().delete_namespaced_service(name, ns),
        ):
            try:
                delete()
            except ApiException as e:
                if e.status != 404:
                    raise
