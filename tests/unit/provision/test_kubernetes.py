"""Kubernetes manifests: an indexed Job + headless Service, validated against the kubernetes client's models.

No cluster here: nothing is applied (the provider applies only when a kubeconfig is given).
"""

import copy
import json

import pytest

from nightloom.provision.base import ProvisionError
from nightloom.provision.k8s import k8s_name, render_manifests, validate_manifests
from nightloom.spec import ClusterSpec, DatasetSpec, KubernetesSpec, NCCLSpec, RunSpec


def _spec(**cluster):
    base = dict(
        provider="kubernetes",
        nodes=3,
        gpus_per_node=8,
        gpu_type="h100-80gb",
        master_port=29500,
        nccl=NCCLSpec(ib_hca="=mlx5_0"),
        kubernetes=KubernetesSpec(namespace="train"),
    )
    base.update(cluster)
    return RunSpec(name="Llama_Run.1", dataset=DatasetSpec(path="/data"), cluster=ClusterSpec(**base))


def test_indexed_job_and_headless_service_validate():
    m = render_manifests(_spec(), ["-m", "nightloom.train", "--job", "/job.json"], {"RUN": "x"})
    models = validate_manifests(m)
    job, svc = models["job"], models["service"]
    assert job.spec.completion_mode == "Indexed" and job.spec.completions == job.spec.parallelism == 3
    assert svc.spec.cluster_ip == "None" and svc.spec.ports[0].port == 29500
    pod = job.spec.template.spec
    assert pod.subdomain == svc.metadata.name == k8s_name("Llama_Run.1") == "nightloom-llama-run-1"
    c = pod.containers[0]
    assert c.resources.limits == {"nvidia.com/gpu": "8"}
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in c.args
    assert f"--master-addr={job.metadata.name}-0.{svc.metadata.name}" in c.args
    assert "--nnodes=3" in c.args and "--nproc-per-node=8" in c.args
    assert c.args[-4:] == ["-m", "nightloom.train", "--job", "/job.json"]
    env = {e.name: e.value for e in c.env}
    assert env["NCCL_IB_HCA"] == "=mlx5_0" and env["RUN"] == "x"
    assert svc.spec.selector.items() <= job.spec.template.metadata.labels.items()  # the Service finds the pods


def test_cpu_spec_requests_no_gpu():
    c = validate_manifests(render_manifests(_spec(gpu_type="cpu"), []))["job"].spec.template.spec.containers[0]
    assert not (c.resources.limits or {})


def test_shell_and_kubernetes_expansions_are_carried_literally():
    m = render_manifests(_spec(), ["--tag", "$(rm -rf /)`id`; echo"], {"X": "$(HOME); rm -rf /"})
    c = validate_manifests(m)["job"].spec.template.spec.containers[0]
    assert "--tag" in c.args and "$$(rm -rf /)`id`; echo" in c.args  # $$( is Kubernetes' literal $(
    assert {e.name: e.value for e in c.env}["X"] == "$$(HOME); rm -rf /"
    assert c.command == ["python"]  # argv is a list: no shell ever parses it


@pytest.mark.parametrize(
    "field,value,needle", [("namespace", "Bad_NS", "namespace"), ("image", "img; rm -rf /", "image")]
)
def test_bad_values_name_the_field(field, value, needle):
    with pytest.raises(ProvisionError, match=needle):
        render_manifests(_spec(kubernetes=KubernetesSpec(**{field: value})), [])


def test_model_validation_catches_a_broken_manifest():
    m = render_manifests(_spec(), [])
    broken = copy.deepcopy(m)
    del broken["job"]["spec"]["template"]["spec"]["containers"][0]["name"]  # required by V1Container
    with pytest.raises(ProvisionError, match="V1Job"):
        validate_manifests(broken)


def test_preflight_outcome_is_unknown_never_passed():
    """No pod exists before launch, so nothing was probed: the report says unknown (an empty report is not a
    healthy one), and recovery does not write "preflight passed on every node"."""
    from nightloom.provision.base import Cluster
    from nightloom.provision.k8s import K8S_PREFLIGHT_UNKNOWN, KubernetesProvider
    from nightloom.recovery import AttemptFailure, classify

    p = KubernetesProvider(_spec())
    c = Cluster(provider="kubernetes", name="c", nodes=[], master_addr="m", master_port=1)
    report = p.preflight(c)
    assert report.outcome == "unknown" and report.unknown_reason == K8S_PREFLIGHT_UNKNOWN
    d = classify(AttemptFailure(attempt=0, exit_code=1, stalled=False, cause="boom", last_step=None), report)
    assert d.kind == "transient" and "outcome unknown" in d.detail and "passed" not in d.detail


class _FakeCore:
    """The one call acquire makes: list pods (the API answers)."""

    def __init__(self):
        self.calls = []

    def list_namespaced_pod(self, namespace, limit):
        self.calls.append((namespace, limit))


def test_provision_check_says_kubernetes_never_ran_live(tmp_path, capsys, monkeypatch):
    from flows.cli import main
    from nightloom.provision.k8s import UNTESTED_LIVE, KubernetesProvider

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: k\ndataset: {path: /tmp}\ncluster: {provider: kubernetes, nodes: 2, gpus_per_node: 8, "
        "gpu_type: h100-80gb, kubernetes: {namespace: train}}\n"
    )
    # without a kubeconfig: fails with the field, and still says it never ran live
    assert main(["provision", str(spec), "--check"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "cluster.provider.kubeconfig" in out and UNTESTED_LIVE in out
    # an API that answers: acquired, but preflight is "unknown", not a pass
    fake = _FakeCore()
    monkeypatch.setattr(KubernetesProvider, "core", lambda self: fake)
    assert main(["provision", str(spec), "--check"]) == 0
    out = capsys.readouterr().out
    assert fake.calls == [("train", 1)]
    assert UNTESTED_LIVE in out and "preflight: unknown (kubernetes: pods do not exist before launch" in out
    assert main(["provision", str(spec), "--check", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["preflight"] == "unknown" and res["notes"] == [UNTESTED_LIVE] and res["nodes"] == []
