"""TrainJob: the one typed record the orchestrator writes and every rank reads (`--job job.json`).

Pure pydantic, no torch, so the orchestrator can build it without importing torch.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from nightloom.parallel import ParallelPlan
from nightloom.spec import TokenizerSpec, TrainSpec


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
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec, description="model.tokenizer of the run.")
    eval_every: int = Field(0, ge=0, description="Held-out eval after step 1, every K steps and at the end (0 = off).")
    eval_windows: int = Field(16, gt=0, description="Eval windows (rounded to whole global batches).")
    eval_data: str | None = Field(None, description="JSONL of eval documents; default the manifest's held-out split.")

    @property
    def metrics_path(self) -> Path:
        return Path(self.run_dir) / "metrics.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.run_dir) / "checkpoints"

    @property
    def result_path(self) -> Path:
        return Path(self.run_dir) / "result.json"


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
