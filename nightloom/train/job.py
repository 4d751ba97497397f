"""TrainJob: the one typed record the orchestrator writes and every rank reads (`--job job.json`).

Pure pydantic, no torch, so the orchestrator can build it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, model_validator

from nightloom.parallel import ParallelPlan
from nightloom.perf import resolve_peak
from nightloom.provision.base import Cluster
from nightloom.records import Record
from nightloom.runfiles import RunFiles
from nightloom.schedule.cost import BillingSpan
from nightloom.shape import ModelShape
from nightloom.spec import RunSpec, TokenizerSpec, TrainSpec
from nightloom.spec.tracking import TrackSpec
from nightloom.storage import S3Config


class TrainJob(Record):
    """Everything a rank needs: model, layout, data, hyper-parameters, where to write, when to stop."""

    run_id: str
    run_dir: str
    model: ModelShape  # the resolved record itself (a dataclass pydantic serialises): no mirror to keep in step
    plan: ParallelPlan
    train: TrainSpec
    manifest: str  # folder, manifest.json path, or s3:// prefix
    s3: S3Config = Field(default_factory=S3Config)  # where s3:// shards and weights live (storage.*, no secrets)
    peak_flops: float | None = Field(None, description="Per-device peak FLOP/s for MFU; None = measure on CPU.")
    peak_source: str | None = None
    deadline_unix: float | None = Field(None, description="Checkpoint and stop cleanly at this wall-clock time.")
    resume: bool = True
    attempt: int = 0
    stop_after_steps: int | None = Field(None, description="Stop (with checkpoint) after this many total steps.")
    preempt_signal: str | None = Field(None, description="A signal handled as SIGTERM is: save and stop.")
    weights: str | None = Field(None, description="Hugging Face safetensors folder or s3:// prefix to start from.")
    hf_config: str | None = Field(None, description="The config.json the model came from (copied on export).")
    tokenizer_dir: str | None = Field(None, description="Tokenizer file or folder whose files the export carries.")
    track: TrackSpec = Field(default_factory=TrackSpec, description="Trackers rank 0 reports every step to.")

    @model_validator(mode="before")
    @classmethod
    def _old_s3_field(cls, data):
        """job.json files written before `s3` had a bare `s3_endpoint_url`: still readable (export, evaluate)."""
        if isinstance(data, dict) and "s3_endpoint_url" in data:
            data = dict(data)
            url = data.pop("s3_endpoint_url")
            data.setdefault("s3", {"endpoint_url": url} if url else {})
        return data

    @property
    def export_format(self) -> str:
        """`train.export` resolved: auto = hf when the model came from a Hugging Face config."""
        if self.train.export != "auto":
            return self.train.export
        return "hf" if self.hf_config else "none"

    @property
    def export_dir(self) -> Path:
        return Path(self.run_dir) / "export"

    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec, description="model.tokenizer of the run.")
    eval_every: int = Field(0, ge=0, description="Held-out eval after step 1, every K steps and at the end (0 = off).")
    eval_windows: int = Field(16, gt=0, description="Eval windows (rounded to whole global batches).")
    eval_data: str | None = Field(None, description="JSONL of eval documents; default the manifest's held-out split.")
    chat_template: str | None = Field(None, description="model.chat_template (sft); default the tokenizer's own.")
    data_style: str = Field("auto", description="dataset.style: how chat records are read (sft eval data).")

    def chat_settings(self, seq_len: int | None = None):
        """train.task sft: nightloom.chat's ChatSettings for rendering eval chats as the shard stage did."""
        from nightloom.chat import ChatSettings, template_text

        template = template_text(self.tokenizer.path or "", self.chat_template)
        return ChatSettings(style=self.data_style, template=template, seq_len=seq_len or self.train.seq_len)

    @classmethod
    def for_run(
        cls,
        spec: RunSpec,
        run_id: str,
        run_dir: str | Path,
        shape: ModelShape,
        plan: ParallelPlan,
        *,
        deadline_unix: float | None = None,
        stop_after_steps: int | None = None,
    ) -> TrainJob:
        """The first attempt's job of a run: the run's resolved model `shape`, training settings
        and data, the plan, the gate's stop conditions, and on a GPU the datasheet peak for the spec's
        precision (on CPU the trainer measures it)."""
        from nightloom.hf.export import tokenizer_source

        gpu = spec.cluster.gpu_type
        peak = None if gpu == "cpu" else resolve_peak(gpu, spec.train.precision)
        return cls(
            run_id=run_id,
            run_dir=str(run_dir),
            model=shape,
            plan=plan,
            train=spec.train,
            manifest=spec.sharding.output,
            s3=S3Config.from_spec(spec.storage),
            peak_flops=peak.flops if peak else None,
            peak_source=peak.source if peak else None,
            deadline_unix=deadline_unix,
            stop_after_steps=stop_after_steps,
            preempt_signal=spec.recovery.preempt_signal,
            track=spec.track,
            weights=spec.model.weights,
            hf_config=spec.model.config,
            tokenizer_dir=tokenizer_source(spec),
            tokenizer=spec.model.tokenizer,
            eval_every=spec.validate_.eval_every,
            eval_windows=spec.validate_.eval_windows,
            eval_data=spec.validate_.eval_data,
            chat_template=spec.model.chat_template,
            data_style=spec.dataset.style,
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


class TrainResult(Record):
    """Written by rank 0 at the end: how far training got and why it stopped."""

    steps_done: int
    total_steps: int
    stopped: str  # "completed" | "deadline" | "stop_after_steps" | "preempted"
    final_loss: float | None
    tokens: int
    wall_s: float
    last_checkpoint: str | None = None
    peak_flops: float | None = None  # per-device peak used for MFU (measured on CPU, datasheet on GPU)
    peak_source: str | None = None
    export_dir: str | None = None  # the Hugging Face export written when training completed
    adapter_dir: str | None = None  # a LoRA run's PEFT adapter (native: inside the export), the summary's row
    conversations_per_row: float | None = None  # train.pack: conversations per packed sequence, on average
    pack_fill: float | None = None  # train.pack: the share of the packed sequences' ids that are conversation tokens
    checkpoint_bytes: int | None = None  # the last checkpoint's size (a LoRA run over model.weights: adapters only)


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
    preemptions: int = 0  # attempts stopped by a preemption notice and relaunched from their checkpoint
    preemption_lost_s: float = 0.0  # their time lost: from the stop to the next attempt's first step
