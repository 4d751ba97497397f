"""TrainJob: the one typed record the orchestrator writes and every rank reads (`--job job.json`).

Pure pydantic, no torch, so the orchestrator can build it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from nightloom.parallel import ParallelPlan
from nightloom.perf import resolve_peak
from nightloom.provision.base import Cluster
from nightloom.runfiles import RunFiles
from nightloom.schedule import BillingSpan
from nightloom.spec import RunSpec, TrainSpec


class ModelConfig(BaseModel):
    """Shape of the model to build (mirrors catalog.ModelShape, serialisable)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    max_seq: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def from_shape(cls, shape) -> ModelConfig:
        return cls(**{k: getattr(shape, k) for k in cls.model_fields})

    def to_shape(self):
        from nightloom.catalog import ModelShape

        return ModelShape(**self.model_dump())


class TrainJob(BaseModel):
    """Everything a rank needs: model, layout, data, hyper-parameters, where to write, when to stop."""

    model_config = ConfigDict(extra="forbid")
    run_id: str
    run_dir: str
    model: ModelConfig
    plan: ParallelPlan
    train: TrainSpec
    manifest: str  # folder, manifest.json path, or s3:// prefix
    s3_endpoint_url: str | None = None
    peak_flops: float | None = Field(None, description="Per-device peak FLOP/s for MFU; None = measure on CPU.")
    peak_source: str | None = None
    deadline_unix: float | None = Field(None, description="Checkpoint and stop cleanly at this wall-clock time.")
    resume: bool = True
    attempt: int = 0
    stop_after_steps: int | None = Field(None, description="Stop (with checkpoint) after this many total steps.")

    @classmethod
    def for_run(
        cls,
        spec: RunSpec,
        run_id: str,
        run_dir: str | Path,
        shape,
        plan: ParallelPlan,
        *,
        deadline_unix: float | None = None,
        stop_after_steps: int | None = None,
    ) -> TrainJob:
        """The first attempt's job of a run: the spec's model `shape` (catalog.ModelShape), training settings
        and data, the plan, the gate's stop conditions, and on a GPU the datasheet peak for the spec's
        precision (on CPU the trainer measures it)."""
        gpu = spec.cluster.gpu_type
        peak = None if gpu == "cpu" else resolve_peak(gpu, spec.train.precision)
        return cls(
            run_id=run_id,
            run_dir=str(run_dir),
            model=ModelConfig.from_shape(shape),
            plan=plan,
            train=spec.train,
            manifest=spec.sharding.output,
            s3_endpoint_url=spec.storage.s3_endpoint_url,
            peak_flops=peak.flops if peak else None,
            peak_source=peak.source if peak else None,
            deadline_unix=deadline_unix,
            stop_after_steps=stop_after_steps,
        )

    @property
    def files(self) -> RunFiles:
        return RunFiles(self.run_dir)

    @property
    def metrics_path(self) -> Path:
        return self.files.metrics

    @property
    def checkpoint_dir(self) -> Path:
        return self.files.checkpoints

    @property
    def result_path(self) -> Path:
        return self.files.result


class TrainResult(BaseModel):
    """Written by rank 0 at the end: how far training got and why it stopped."""

    model_config = ConfigDict(extra="forbid")
    steps_done: int
    total_steps: int
    stopped: str  # "completed" | "deadline" | "stop_after_steps"
    final_loss: float | None
    tokens: int
    wall_s: float
    last_checkpoint: str | None = None
    peak_flops: float | None = None  # per-device peak used for MFU (measured on CPU, datasheet on GPU)
    peak_source: str | None = None


@dataclass
class TrainOutcome:
    """What the train stage returns, whichever backend ran it: the result, the cluster and plan the run finished
    on (recovery may have changed both), the billed spans, and the interruptions recovered from."""

    result: TrainResult
    cluster: Cluster
    plan: ParallelPlan
    spans: list[BillingSpan] = field(default_factory=list)  # each attempt (and its recovery) at its size
    train_s: float = 0.0
    interruptions: int = 0
    recovery_s: float = 0.0
