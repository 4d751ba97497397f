"""Kubernetes manifests: an indexed Job + headless Service, validated against the kubernetes client's models.

No cluster here: nothing is applied (the provider applies only when a kubeconfig is given).
"""

import copy

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
