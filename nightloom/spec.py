"""RunSpec: the declarative run spec, validated once at the edge.

`load_spec(path)` reads YAML and reports *every* invalid field at once as `FILE: field.path: reason`;
unknown keys are errors so a typo is never silently ignored. Relative paths in a spec file resolve
against the directory of that file; in a spec built in Python they resolve against the working directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class SpecError(ValueError):
    """A spec that cannot be used; `errors` holds one `FILE: field.path: reason` line per problem."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid run spec:\n  " + "\n  ".join(errors))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Section):
    """Which model to train: a catalog name (see nightloom/catalog.py) or a Hugging Face config.json."""

    name: str = Field("tiny", description="Catalog model name, e.g. tiny, llama2-7b, llama3-70b.")
    config: str | None = Field(None, description="Path to a Hugging Face config.json; overrides `name`.")


class DatasetSpec(_Section):
    """The training corpus: a local path or s3:// prefix; `sample: true` builds the embedded sample."""

    path: str = Field(..., description="JSONL(.gz/.zst), Parquet, a folder of .txt files, or save_to_disk folder.")
    format: Literal["auto", "jsonl", "parquet", "text", "hf"] = "auto"
    text_field: str = Field("text", description="Field holding the document text.")
    keep_columns: list[str] = Field(
        default_factory=list,
        description="Extra fields copied into every shard row as strings (non-string values such as lists or "
        "dicts, e.g. OpenAI `messages`, are JSON-encoded; null stays null); a missing one is a bad record "
        "(file:line, honours sharding.on_error). Hashing, dedup, balance and token counts use only key/text. "
        "Not for text-file folders.",
    )
    sample: bool = Field(False, description="Build the deterministic sample corpus at `path` if it is missing.")
    sample_kind: Literal["docstrings", "alpaca"] = Field(
        "docstrings", description="docstrings: {id, text}; alpaca: {id, instruction, input, output} (fine-tuning)."
    )
    tokenizer: Literal["bytes"] = Field(
        "bytes", description="Tokenizer for counting and training; `bytes` = UTF-8 bytes (vocab 256)."
    )


class DaskSpec(_Section):
    """A Dask cluster for the shard stage's scan and write tasks (prefect-dask's DaskTaskRunner).

    Output bytes do not depend on it: the same shards as on one machine."""

    address: str | None = Field(None, description="Scheduler of a running cluster, e.g. tcp://10.0.0.2:8786.")
    cluster_class: str | None = Field(
        None, description="Or a cluster to start for the run, e.g. dask_jobqueue.SLURMCluster (pip install it)."
    )
    cluster_kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments of cluster_class.")

    @model_validator(mode="after")
    def _one_way(self) -> DaskSpec:
        if (self.address is None) == (self.cluster_class is None):
            raise ValueError("set exactly one of address (a running scheduler) and cluster_class (one to start)")
        if self.cluster_kwargs and self.cluster_class is None:
            raise ValueError("cluster_kwargs needs cluster_class")
        return self


class ShardingSpec(_Section):
    """Hash sharding: shard = xxhash64(key ‖ salt) mod num_shards, balanced within `tolerance`."""

    num_shards: int = Field(8, gt=0, description="Number of Parquet shards.")
    output: str = Field(".nightloom/shards", description="Local folder or s3:// prefix for shards + manifest.")
    key_field: str | None = Field(None, description="Field used as the hash key; default the text itself.")
    salt: str = Field("nightloom", description="Salt mixed into the hash; change it to reshuffle.")
    balance_by: Literal["rows", "tokens", "bytes"] = "tokens"
    tolerance: float = Field(0.02, gt=0, lt=1, description="Max |x_i - mean| / mean over shards.")
    dedup: bool = Field(True, description="Drop exact duplicate keys after the first.")
    on_error: Literal["fail", "skip"] = "fail"
    max_bad_fraction: float = Field(0.01, ge=0, le=1, description="With on_error=skip: fail above this.")
    compression: Literal["zstd", "snappy", "lz4", "none"] = Field(
        "zstd", description="Parquet codec of the shards: zstd (level 1) is ~2.5× smaller than none on text."
    )
    dask: DaskSpec | None = Field(None, description="Run the scan and write tasks on a Dask cluster.")


class SSHHost(_Section):
    """One SSH machine the user already rents."""

    host: str
    port: int = Field(22, gt=0, lt=65536)
    user: str = "root"
    gpus: int = Field(1, gt=0)
    python: str = Field("python3", description="Interpreter on the node used for training.")
    workdir: str = Field("~/nightloom", description="Working folder on the node.")
    spare: bool = Field(False, description="A spare host used only to replace a failed node.")


class SSHSpec(_Section):
    hosts: list[SSHHost] = Field(default_factory=list)
    key_secret: str | None = Field(None, description="Prefect Secret block holding the private key.")
    key_env: str = Field("NIGHTLOOM_SSH_KEY", description="Env var holding the private key (or a path).")
    known_hosts: str = Field("~/.ssh/known_hosts", description="known_hosts file; host keys are always verified.")


class SlurmSpec(_Section):
    partition: str = "debug"
    account: str | None = None
    time_limit: str = "01:00:00"
    exclude: list[str] = Field(default_factory=list)
    python: str | None = Field(
        None, description="Interpreter on the nodes (shared file system); default: the orchestrator's own."
    )
    extra_sbatch: list[str] = Field(default_factory=list, description="Extra `#SBATCH` options, as given.")


class KubernetesSpec(_Section):
    namespace: str = "default"
    image: str = "nvcr.io/nvidia/pytorch:24.10-py3"
    kubeconfig: str | None = None
    gpu_resource: str = "nvidia.com/gpu"


class NCCLSpec(_Section):
    """NCCL/InfiniBand settings rendered to env vars and validated; unset fields are left to NCCL."""

    ib_disable: bool | None = None
    p2p_disable: bool | None = None
    ib_hca: str | None = Field(None, description="e.g. '=mlx5_0,mlx5_1' (leading '=' = exact match).")
    socket_ifname: str | None = None
    buffsize: int | None = Field(None, gt=0)
    ib_gid_index: int | None = Field(None, ge=0)
    debug: Literal["OFF", "VERSION", "WARN", "INFO", "TRACE"] = "OFF"


class ClusterSpec(_Section):
    """Where training runs. `local` = process groups on this machine (the embedded default)."""

    provider: Literal["local", "ssh", "slurm", "kubernetes"] = "local"
    name: str = Field("local", description="Cluster name: the concurrency limit key (one run per cluster).")
    nodes: int = Field(2, gt=0)
    gpus_per_node: int = Field(2, gt=0, description="GPUs (or CPU ranks on `local`) per node.")
    gpu_type: str = Field("cpu", description="Catalog GPU type, or `cpu` (peak measured at run time).")
    master_port: int = Field(29500, gt=1024, lt=65536)
    min_free_disk_gib: float = Field(1.0, ge=0)
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
    ssh: SSHSpec = Field(default_factory=SSHSpec)
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)
    nccl: NCCLSpec = Field(default_factory=NCCLSpec)


class ParallelSpec(_Section):
    """Explicit parallel degrees; leave `parallel: auto` in the spec to let the planner choose. The rules are
    nightloom.parallel.ParallelDims.check's (run at load time when the model is known)."""

    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    dp_replicate: int = Field(1, gt=0, description="Replicas (plain data parallel); HSDP's replica groups.")
    dp_shard: int = Field(-1, description="Ranks sharding with FSDP2; -1 = whatever is left of the world size.")
    cp: int = Field(1, gt=0, description="Context parallel (GPU only).")
    sp: bool = Field(False, description="Sequence parallel with TP (Megatron-SP).")
    micro_batch: int = Field(1, gt=0)
    virtual_stages: int = Field(1, gt=0)
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    recompute: Literal["none", "selective", "full"] = "none"
    zero: Literal["fsdp", "zero2"] = Field(
        "fsdp", description="How dp_shard shards: fsdp (ZeRO-3) or zero2 (parameters kept from forward to backward)."
    )
    stages: list[int] | None = Field(None, description="Transformer layers per pipeline stage (uneven split).")

    @field_validator("zero", mode="before")
    @classmethod
    def _zero(cls, v):
        if v == "none":
            raise ValueError("'none' is not a sharding mode: plain data parallel is dp_replicate: N with dp_shard: 1")
        return v

    @field_validator("dp_shard")
    @classmethod
    def _dp_shard(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"must be >= 1, or -1 for the rest of the world size, got {v}")
        return v

    @model_validator(mode="after")
    def _stages(self) -> ParallelSpec:
        n = self.pp * (self.virtual_stages if self.schedule == "interleaved_1f1b" else 1)
        if self.stages is not None and (len(self.stages) != n or min(self.stages) < 1):
            raise ValueError(f"stages {self.stages}: give pp·virtual_stages ({n}) sizes, each >= 1")
        return self


class XTunerSpec(_Section):
    method: Literal["full", "lora", "qlora"] = "lora"
    base_model: str = Field("", description="Local Hugging Face folder or s3:// prefix.")
    map_fn: str = "alpaca"
    template: str = "default"
    zero_stage: Literal[0, 1, 2, 3] = 0
    sequence_parallel_size: int = Field(1, gt=0)
    merge_lora: bool = True
    build_tiny_base_model: bool = Field(
        False, description="Build a tiny random Llama at base_model on first use (demos and tests only)."
    )
    python: str | None = Field(None, description="Interpreter of the XTuner node env; created when unset.")
    amp: Literal["auto", "fp16", "bf16"] = Field(
        "auto", description="GPU mixed precision for XTuner (auto = bf16); CPU always trains in fp32."
    )


class TrainSpec(_Section):
    """Training hyper-parameters; the same on every backend."""

    backend: Literal["native", "xtuner"] = "native"
    steps: int = Field(30, gt=0)
    seq_len: int = Field(128, gt=0)
    global_batch: int = Field(8, gt=0, description="Sequences per optimizer step across all DP ranks.")
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(3, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="adamw (betas 0.9, 0.95), or plain sgd: its update scales with the gradient."
    )
    seed: int = 1234
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto = bf16 on GPU, fp32 on CPU.")
    checkpoint_every: int = Field(0, ge=0, description="Save a DCP checkpoint every K steps (0 = only at end).")
    collective_timeout_s: int = Field(120, gt=0)
    metrics_port: int | None = Field(None, description="Prometheus endpoint base port (rank r uses port+r).")
    xtuner: XTunerSpec | None = None


class GoldenSpec(_Section):
    path: str | None = Field(None, description="JSONL of {step, loss}; or use `from_ledger`.")
    from_ledger: bool = False
    rtol: float = Field(0.05, gt=0)


class ValidateSpec(_Section):
    """Gates a run must pass; a failing gate fails the flow with its reason."""

    mfu_floor: float = Field(0.0, ge=0, lt=1, description="Minimum measured MFU (0 = no floor).")
    mfu_vs_plan: float = Field(0.0, ge=0, le=2, description="Measured MFU >= this fraction of the planned MFU.")
    min_loss_drop: float = Field(0.05, ge=0, lt=1, description="Fitted loss must fall by this fraction.")
    window: int = Field(0, ge=0, description="Steps in the convergence window (0 = whole run).")
    spike_k: float = Field(8.0, gt=0, description="A spike is a loss above k × MAD of the trend.")
    spike_min_rise: float = Field(0.25, ge=0, description="... and above the trailing median by this fraction.")
    spike_sustain: int = Field(3, ge=1, description="... for this many consecutive steps (hard batches pass).")
    grad_norm_max: float | None = Field(None, gt=0)
    golden: GoldenSpec = Field(default_factory=GoldenSpec)

    @model_validator(mode="before")
    @classmethod
    def _parity_removed(cls, data):
        if isinstance(data, dict) and "parity" in data:
            raise ValueError(
                "`parity` was removed: a run trains one layout, so no reference losses existed and the gate could "
                "only fail. Layout parity is tested in tests/distributed/test_parity.py; to hold a run to a known "
                "loss curve use validate.golden (a path or from_ledger)"
            )
        return data


class WindowSpec(_Section):
    start: str = Field("02:00", description="HH:MM local time in the schedule's time zone.")
    end: str = Field("06:00", description="HH:MM; may be earlier than start (crosses midnight).")

    @field_validator("start", "end")
    @classmethod
    def _hhmm(cls, v: str) -> str:
        if not re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d", v):
            raise ValueError(f"expected HH:MM (00:00–23:59), got {v!r}")
        return v


class ScheduleSpec(_Section):
    """Off-peak windows, prices and what to do outside a window."""

    timezone: str = "Asia/Shanghai"
    windows: list[WindowSpec] = Field(default_factory=lambda: [WindowSpec()])
    policy: Literal["wait", "run-now", "split"] = "run-now"
    price_per_gpu_hour: float = Field(0.0, ge=0)
    offpeak_discount: float = Field(0.18, ge=0, lt=1)
    currency: str = "USD"
    budget: float | None = Field(None, gt=0, description="Refuse or stop a run whose cost would exceed it.")
    max_nights: int | None = Field(
        None, ge=1, description="Refuse, before renting, a run whose plan needs more nights (windows) than this."
    )
    provisioning_minutes: float | None = Field(
        None,
        ge=0,
        description="Minutes from renting to ready, billed, when the ledger has no measured time to ready for "
        "this cluster (default 10).",
    )
    checkpoint_gb_per_s: float = Field(
        2.0, gt=0, description="Checkpoint storage bandwidth (GB/s, all ranks together): save and restore time."
    )

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {v!r}") from None
        return v


class StorageSpec(_Section):
    root: str = Field(".nightloom/runs", description="Run folders: metrics, checkpoints, plots.")
    s3_endpoint_url: str | None = Field(None, description="For S3-compatible stores (SeaweedFS, MinIO...).")
    s3_region: str = "us-east-1"
    credentials_secret: str | None = Field(None, description="Prefect Secret block with 'KEY_ID:SECRET'.")


class LedgerSpec(_Section):
    url: str = Field("sqlite:///.nightloom/ledger.db", description="Any SQLAlchemy URL.")


class RecoverySpec(_Section):
    max_attempts: int = Field(0, ge=0, description="Re-launches after a failure (0 = fail at once).")
    max_minutes: float = Field(30.0, gt=0)
    allow_relayout: bool = True
    spare_nodes: int = Field(0, ge=0)


class RunSpec(_Section):
    """One declarative run: what to train, on what data, where, how, and what counts as success."""

    name: str = Field(..., description="Run name: letters, digits, '-', '_', '.'.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    dataset: DatasetSpec
    sharding: ShardingSpec = Field(default_factory=ShardingSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    parallel: Literal["auto"] | ParallelSpec = "auto"
    train: TrainSpec = Field(default_factory=TrainSpec)
    validate_: ValidateSpec = Field(default_factory=ValidateSpec, alias="validate")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    ledger: LedgerSpec = Field(default_factory=LedgerSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", v):
            raise ValueError(f"must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> RunSpec:
        if self.train.backend == "xtuner" and self.train.xtuner is None:
            raise ValueError("train.xtuner: required when train.backend is 'xtuner'")
        return self

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    def spec_hash(self) -> str:
        """Stable hash of the spec's content (ledger key: same spec ⇒ same hash)."""
        blob = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def resolved(self, base_dir: Path) -> RunSpec:
        """A copy whose local relative paths are absolute, against `base_dir`."""
        spec = self.model_copy(deep=True)

        def fix(p: str | None) -> str | None:
            if p is None or "://" in p or Path(p).expanduser().is_absolute():
                return p
            return str((base_dir / p).resolve())

        spec.dataset.path = fix(spec.dataset.path)
        spec.sharding.output = fix(spec.sharding.output)
        spec.storage.root = fix(spec.storage.root)
        spec.model.config = fix(spec.model.config)
        spec.validate_.golden.path = fix(spec.validate_.golden.path)
        if spec.ledger.url.startswith("sqlite:///") and not spec.ledger.url.startswith("sqlite:////"):
            spec.ledger.url = "sqlite:///" + fix(spec.ledger.url[len("sqlite:///") :])
        if spec.train.xtuner is not None:
            spec.train.xtuner.base_model = fix(spec.train.xtuner.base_model) or ""
        return spec


def _yaml_line(path: Path, text: str, loc: tuple) -> int | None:
    """Best-effort line number of a field path in a YAML document (for error messages)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == key:
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def format_errors(err: ValidationError, source: str, text: str | None = None) -> list[str]:
    """One `SOURCE[:LINE]: field.path: reason` per pydantic error."""
    out = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith(("function-after", "literal["))))
        loc = tuple("validate" if x == "validate_" else x for x in loc)
        # the `parallel` union reports both branches; keep the ParallelSpec one (it names the field)
        if loc[:1] == ("parallel",) and len(loc) > 1 and loc[1] == "ParallelSpec":
            loc = ("parallel",) + loc[2:]
        path = ".".join(str(x) for x in loc) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (typo?)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        where = source
        if text is not None:
            line = _yaml_line(Path(source), text, loc)
            if line:
                where = f"{source}:{line}"
        out.append(f"{where}: {path}: {msg}")
    # dedupe while keeping order (union branches can repeat a message)
    seen: set[str] = set()
    return [x for x in out if not (x in seen or seen.add(x))]


def _get(data: dict, *path, default=None):
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def _semantic_errors(data: dict, base_dir: Path) -> list[tuple[tuple, str]]:
    """Checks that need the filesystem or the catalog: (field path, reason), before anything is rented.

    They read the raw mapping (not the validated model) so they are reported together with schema errors."""
    from nightloom.catalog import GPUS, MODELS

    def local(p) -> Path | None:
        if not isinstance(p, str) or "://" in p:
            return None
        q = Path(p).expanduser()
        return q if q.is_absolute() else base_dir / q

    errs: list[tuple[tuple, str]] = []
    name, config = _get(data, "model", "name", default="tiny"), _get(data, "model", "config")
    if config is None and isinstance(name, str) and name not in MODELS:
        errs.append((("model", "name"), f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}"))
    if local(config) is not None and not local(config).is_file():
        errs.append((("model", "config"), f"file not found: {local(config)}"))
    gpu = _get(data, "cluster", "gpu_type", default="cpu")
    if isinstance(gpu, str) and gpu != "cpu" and gpu not in GPUS:
        errs.append((("cluster", "gpu_type"), f"unknown GPU {gpu!r}; known: cpu, {', '.join(sorted(GPUS))}"))
    dpath = local(_get(data, "dataset", "path"))
    if dpath is not None and _get(data, "dataset", "sample") is not True and not dpath.exists():
        errs.append((("dataset", "path"), f"not found: {dpath}"))
    nodes, per = _get(data, "cluster", "nodes", default=2), _get(data, "cluster", "gpus_per_node", default=2)
    errs += _parallel_errors(data, base_dir, nodes, per)
    if _get(data, "cluster", "provider") == "ssh":
        hosts = _get(data, "cluster", "ssh", "hosts", default=[]) or []
        active = [h for h in hosts if isinstance(h, dict) and not h.get("spare")]
        if isinstance(nodes, int) and len(active) < nodes:
            errs.append((("cluster", "ssh", "hosts"), f"{len(active)} non-spare hosts for cluster.nodes={nodes}"))
    return errs


def _parallel_errors(data: dict, base_dir: Path, nodes, per) -> list[tuple[tuple, str]]:
    """An explicit `parallel:` section against the world size and the model: ParallelDims.resolve fills
    dp_shard=-1, ParallelDims.check gives the reasons (the rules the planner and the trainer apply)."""
    from nightloom.catalog import MODELS, shape_from_hf_config
    from nightloom.parallel import LayoutError, ParallelDims

    par = _get(data, "parallel")
    if not isinstance(par, dict) or not all(isinstance(x, int) and x > 0 for x in (nodes, per)):
        return []
    try:
        p = ParallelSpec.model_validate(par)
    except ValidationError:
        return []  # the schema errors are reported already
    try:
        dims = ParallelDims.resolve(
            nodes * per,
            tp=p.tp,
            pp=p.pp,
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            cp=p.cp,
            sp=p.sp,
            virtual_stages=p.virtual_stages,
            schedule=p.schedule,
            recompute=p.recompute,
            zero=p.zero,
            stages=tuple(p.stages) if p.stages else None,
        )
    except LayoutError as e:
        return [(("parallel",), f"{e} (cluster.nodes·cluster.gpus_per_node)")]
    name, config = _get(data, "model", "name", default="tiny"), _get(data, "model", "config")
    try:
        if isinstance(config, str) and "://" not in config:
            q = Path(config).expanduser()
            shape = shape_from_hf_config(q if q.is_absolute() else base_dir / q)
        elif config is None and name in MODELS:
            shape = MODELS[name]
        else:
            return []
    except (OSError, ValueError, KeyError):
        return []  # reported under model.*
    seq = _get(data, "train", "seq_len", default=128)
    gb = _get(data, "train", "global_batch", default=8)
    if not (isinstance(seq, int) and isinstance(gb, int)):
        return []
    # micro_batch is pinned, grad_accum follows from the global batch (as the planner sets it)
    per_rank = gb // dims.dp if gb % dims.dp == 0 else 0
    accum = per_rank // p.micro_batch if per_rank and per_rank % p.micro_batch == 0 else 0
    if accum:
        dims = dataclasses.replace(dims, grad_accum=accum)
    else:
        return [
            (
                ("parallel", "micro_batch"),
                f"train.global_batch ({gb}) is not divisible by micro_batch ({p.micro_batch}) · dp ({dims.dp})",
            )
        ]
    return [(("parallel",), why) for why in dims.check(shape, seq, gb)]


def parse_spec(data: object, source: str = "<spec>", text: str | None = None, base_dir: Path | None = None) -> RunSpec:
    """Validate a mapping into a RunSpec; raise SpecError listing every problem (schema and semantic) at once."""
    if not isinstance(data, dict):
        raise SpecError([f"{source}: <root>: expected a mapping of sections, got {type(data).__name__}"])
    base_dir = base_dir or Path.cwd()
    errors: list[str] = []
    spec = None
    try:
        spec = RunSpec.model_validate(data)
    except ValidationError as err:
        errors += format_errors(err, source, text)
    for loc, msg in _semantic_errors(data, base_dir):
        line = _yaml_line(Path(source), text, loc) if text is not None else None
        errors.append(f"{source}{f':{line}' if line else ''}: {'.'.join(loc)}: {msg}")
    if errors or spec is None:
        raise SpecError(errors)
    return spec.resolved(base_dir)


def load_spec(path: str | Path) -> RunSpec:
    """Read and validate a YAML run spec; errors name the file, line and field path."""
    p = Path(path)
    if not p.is_file():
        raise SpecError([f"{p}: file not found"])
    text = p.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        raise SpecError([f"{where}: invalid YAML: {getattr(err, 'problem', err)}"]) from None
    return parse_spec(data, source=str(p), text=text, base_dir=p.resolve().parent)


def coerce_spec(spec: RunSpec | str | Path | dict) -> RunSpec:
    """Accept what users pass (a spec, a path, a dict from the UI) and return a validated RunSpec."""
    if isinstance(spec, RunSpec):
        return parse_spec(spec.model_dump(by_alias=True), source="<RunSpec>")
    if isinstance(spec, dict):
        return parse_spec(spec, source="<parameters>")
    return load_spec(spec)
