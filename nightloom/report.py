"""RunSummary: what one pipeline run did, returned by the flow and printed by the CLI."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StageTime(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stage: str
    seconds: float


class RunSummary(BaseModel):
    """The outcome of `training_pipeline`: status, figures per stage, and where things were written."""

    model_config = ConfigDict(extra="forbid")
    run_id: str
    name: str
    status: str  # completed | failed | deferred | split | refused
    reason: str = ""
    run_dir: str = ""
    shards: int = 0
    shard_imbalance: float | None = None
    shards_balanced: bool | None = None
    layout: str = ""
    world_size: int = 0
    steps: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mfu_predicted: float | None = None
    peak_source: str = ""
    cost: float | None = None
    currency: str = ""
    ledger_id: str | None = None  # the ledger row key (the run id)
    verdicts: list[dict] = Field(default_factory=list)
    stages: list[StageTime] = Field(default_factory=list)
    next_run_at: str | None = None
    interruptions: int = 0  # failures recovered from (or given up on) during training
    recovery_s: float = 0.0  # total time to recover over those interruptions
    export_dir: str | None = None  # the Hugging Face export (train.export: hf), written before the gates
    nights_used: int = 0  # nights (stretches of renting) this run has used, this one included
    nights_left: int | None = None  # predicted nights still to come (None: unknown, no prediction)
    predicted_finish: str | None = None  # ISO time in the schedule's zone (None: unknown or finished)

    def nights_text(self) -> str:
        """'2 used, 1 left; predicted finish 2026-12-03T02:24:00+08:00' (the run-summary row)."""
        left = "unknown" if self.nights_left is None else str(self.nights_left)
        finish = f"; predicted finish {self.predicted_finish}" if self.predicted_finish else ""
        return f"{self.nights_used} used, {left} left{finish}"
