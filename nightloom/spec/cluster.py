"""The run spec's `cluster` section: where the nodes come from (local, SSH hosts, a Slurm partition, Kubernetes),
how many, and the NCCL/InfiniBand environment. A leaf beside schema.py (the package re-exports these names)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nightloom.spec.base import Section as _Section

__all__ = [  # the package (nightloom/spec/__init__.py) and the old nightloom.spec_cluster re-export these
    "PROVIDER_KINDS",
    "ClusterSpec",
    "KubernetesSpec",
    "LocalSpec",
    "NCCLSpec",
    "ProviderSpec",
    "SSHHost",
    "SSHSpec",
    "SlurmSpec",
]

#: the description of each provider's `kind`: the choice of provider that shows its section
_KIND = "Which provider these settings are for (on the Run form: the provider chosen above)."


class SSHHost(_Section):
    """One SSH machine the user already rents."""

    host: str = Field(..., description="Host name or address the orchestrator connects to.")
    port: int = Field(22, gt=0, lt=65536, description="SSH port.")
    user: str = Field("root", description="SSH user on the node.")
    gpus: int = Field(1, gt=0, description="GPUs on this host.")
    python: str = Field("python3", description="Interpreter on the node used for training.")
    workdir: str = Field("~/nightloom", description="Working folder on the node.")
    spare: bool = Field(False, description="A spare host used only to replace a failed node.")


class LocalSpec(_Section):
    """Process groups on this machine, one per node (the embedded default); nothing to set."""

    model_config = ConfigDict(title="local")
    kind: Literal["local"] = Field("local", description=_KIND)


class SSHSpec(_Section):
    """Machines you already rent, reached over SSH."""

    model_config = ConfigDict(title="ssh")
    kind: Literal["ssh"] = Field("ssh", description=_KIND)
    hosts: list[SSHHost] = Field(default_factory=list, description="The hosts, cluster.nodes of them plus spares.")
    key_secret: str | None = Field(None, description="Prefect Secret block holding the private key.")
    key_env: str = Field("NIGHTLOOM_SSH_KEY", description="Env var holding the private key (or a path).")
    known_hosts: str = Field("~/.ssh/known_hosts", description="known_hosts file; host keys are always verified.")


class SlurmSpec(_Section):
    """One sbatch allocation per run."""

    model_config = ConfigDict(title="slurm")
    kind: Literal["slurm"] = Field("slurm", description=_KIND)
    partition: str = Field("debug", description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account (default: the user's own).")
    time_limit: str = Field("01:00:00", description="sbatch --time, as Slurm writes it (HH:MM:SS or D-HH:MM:SS).")
    exclude: list[str] = Field(default_factory=list, description="Node names never to allocate (sbatch --exclude).")
    python: str | None = Field(
        None, description="Interpreter on the nodes (shared file system); default: the orchestrator's own."
    )
    extra_sbatch: list[str] = Field(default_factory=list, description="Extra `#SBATCH` options, as given.")


class KubernetesSpec(_Section):
    """An indexed Job and a headless Service per run."""

    model_config = ConfigDict(title="kubernetes")
    kind: Literal["kubernetes"] = Field("kubernetes", description=_KIND)
    namespace: str = Field("default", description="Namespace of the run's Job and Service.")
    image: str = Field("nvcr.io/nvidia/pytorch:24.10-py3", description="Container image of the pods (torch inside).")
    kubeconfig: str | None = Field(None, description="kubeconfig file; default in-cluster config, then ~/.kube/config.")
    gpu_resource: str = Field("nvidia.com/gpu", description="Extended resource name requested per pod for GPUs.")


PROVIDER_KINDS = ("local", "ssh", "slurm", "kubernetes")


def _any_of(schema: dict) -> None:
    """Prefect's Run form (3.9.1) renders `anyOf` as a selector of its branches and has no `oneOf`: publish the
    discriminated union as `anyOf` (the `discriminator` keyword stays, for other readers of the schema)."""
    if "oneOf" in schema:
        schema["anyOf"] = schema.pop("oneOf")


#: where training runs, one settings section per provider, chosen by `kind`
ProviderSpec = Annotated[
    LocalSpec | SSHSpec | SlurmSpec | KubernetesSpec, Field(discriminator="kind", json_schema_extra=_any_of)
]


class NCCLSpec(_Section):
    """NCCL/InfiniBand settings rendered to env vars and validated; unset fields are left to NCCL."""

    ib_disable: bool | None = Field(
        None, description="NCCL_IB_DISABLE: true = no InfiniBand (sockets); unset = NCCL's."
    )
    p2p_disable: bool | None = Field(None, description="NCCL_P2P_DISABLE: true = no GPU peer-to-peer (NVLink/PCIe).")
    ib_hca: str | None = Field(
        None, description="NCCL_IB_HCA: HCAs to use, e.g. '=mlx5_0,mlx5_1' (leading '=' = exact match)."
    )
    socket_ifname: str | None = Field(
        None, description="NCCL_SOCKET_IFNAME: network interfaces for bootstrap and sockets, e.g. eth0 or ^lo,docker."
    )
    buffsize: int | None = Field(None, gt=0, description="NCCL_BUFFSIZE: bytes per channel buffer, a power of two.")
    ib_gid_index: int | None = Field(None, ge=0, description="NCCL_IB_GID_INDEX: the GID index (RoCE: often 3).")
    debug: Literal["OFF", "VERSION", "WARN", "INFO", "TRACE"] = Field(
        "OFF", description="NCCL_DEBUG: log level of NCCL in the training logs (OFF = not set)."
    )


class ClusterSpec(_Section):
    """Where training runs: the provider (its `kind` and only its settings) and the nodes to rent."""

    provider: ProviderSpec = Field(
        default_factory=LocalSpec, description="The provider (`kind`) and its settings: local, ssh, slurm, kubernetes."
    )
    name: str = Field("local", description="Cluster name: the concurrency limit key (one run per cluster).")
    nodes: int = Field(2, gt=0, description="Nodes to rent (on `local`: process groups on this machine).")
    gpus_per_node: int = Field(2, gt=0, description="GPUs (or CPU ranks on `local`) per node.")
    gpu_type: str = Field("cpu", description="Catalog GPU type, or `cpu` (peak measured at run time).")
    master_port: int = Field(
        29500,
        gt=1024,
        lt=65536,
        description="Rendezvous port on the first node. The local provider, when it is not set, takes a free one.",
    )
    min_free_disk_gib: float = Field(1.0, ge=0, description="Preflight: free disk a node needs (GiB).")
    min_nodes: int | None = Field(
        None,
        gt=0,
        description="Fewest healthy nodes to go on with after preflight "
        "excludes failing ones (re-planned); default: all of `nodes`.",
    )
    env_requirements: list[str] = Field(
        default_factory=list,
        description="Extra pip requirements of the node "
        "environment (keyed by their hash); torch comes from the node image.",
    )
    nccl: NCCLSpec = Field(default_factory=NCCLSpec, description="NCCL/InfiniBand environment of the ranks.")

    @model_validator(mode="before")
    @classmethod
    def _one_provider_section(cls, data):
        """The spelling before the union, `provider: slurm` beside a `slurm:` section, reads as
        `provider: {kind: slurm, ...}`; sections of providers not chosen are dropped (they were never read)."""
        if not isinstance(data, dict) or not isinstance(data.get("provider", "local"), str):
            return data
        data = dict(data)
        kind = data.pop("provider", "local")
        sections = {k: data.pop(k) for k in PROVIDER_KINDS[1:] if k in data}
        chosen = sections.get(kind)
        if isinstance(chosen, BaseModel):  # ClusterSpec(provider="slurm", slurm=SlurmSpec(...)) in Python
            data["provider"] = chosen
        elif chosen is None or isinstance(chosen, dict):
            data["provider"] = {**(chosen or {}), "kind": kind}
        else:
            raise ValueError(f"cluster.{kind}: expected a mapping of {kind} settings, got {type(chosen).__name__}")
        return data
