"""The ledger's records: one run's row (RunRecord), its interruptions and nights, typed (pydantic), and LedgerError.

A row's model and family are the model the run trained (nightloom/ledger/model.py), not the spec's catalog name.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, Self

from pydantic import Field, model_validator

from nightloom.gates import Verdict, gated
from nightloom.ledger.model import model_family
from nightloom.parallel import ParallelPlan
from nightloom.records import Record

RunStatus = Literal["running", "succeeded", "failed", "cancelled", "stopped", "deferred", "refused"]
RUN_STATUSES: tuple[str, ...] = RunStatus.__args__  # type: ignore[attr-defined]


class LedgerError(RuntimeError):
    """A ledger that cannot be used (newer schema, unknown run id, bad field); the message says which."""


class Figure(Record):
    """One task-specific figure of a run (schema 7): a preference run's reward accuracy, a benchmark's score. `name`
    says what it is (TRL's metric names: `rewards/accuracies`; a benchmark: `bench/TASK/METRIC`); `base` is the
    base model's value where one was measured, so the row reads base vs tuned."""

    name: str
    value: float
    stderr: float | None = None
    base: float | None = None


class Interruption(Record):
    """One failed attempt that recovery handled (`kind`: node, network or transient, from the preflight re-run
    after it), how long recovery took, the time lost and its cost. A split run's window ends are nights."""

    at: datetime
    kind: str
    detail: str = ""
    recovery_s: float | None = None
    lost_s: float | None = None  # wall time lost: detection + recovery + steps redone since the checkpoint
    cost: float | None = None  # what the lost time cost (GPUs × lost_s at the schedule's price)


class NightRecord(Record):
    """One night (one stretch of renting) of a run: what the plan predicted for it and what it did and cost."""

    night: int  # 1-based
    start: datetime
    end: datetime
    steps: int  # trained this night
    steps_done: int  # at the end of this night (the checkpoint it left)
    cost: float  # actual, from the billing spans
    stopped: str = ""  # completed | window | budget | failed ...
    predicted_steps: int | None = None
    predicted_cost: float | None = None
    uncertainty: float | None = None  # ± on predicted_cost
    predicted_nights: int | None = None  # the whole run's, as planned at this night's start
    predicted_finish: datetime | None = None


class RunRecord(Record):
    """One ledger row, typed."""

    run_id: str
    spec_hash: str
    name: str
    model: str  # the model the run trained (nightloom.ledger.model.run_model), e.g. chat-sft-demo-qwen2
    family: str = ""  # its family, the calibration's key (qwen2, llama2, ...); "" = the family of `model`'s name
    task: str = ""  # pretrain | sft | dpo | ... (nightloom.ledger.model.run_task); "" = older row, not known
    cluster: str
    provider: str
    gpu_type: str
    world_size: int
    layout: str | None = None
    plan: ParallelPlan | None = None
    predicted_mfu: float | None = None
    measured_mfu: float | None = None
    hfu: float | None = None
    tokens_per_s: float | None = None
    final_loss: float | None = None
    time_to_ready_s: float | None = None
    duration_s: float | None = None
    cost: float | None = None
    currency: str = "USD"
    precision: str | None = None
    peak_source: str | None = None
    verdicts: list[Verdict] = Field(default_factory=list)
    figures: list[Figure] = Field(default_factory=list)  # the task's own figures (Figure), beside the gates
    status: RunStatus = "running"
    reason: str | None = None
    started_at: datetime
    finished_at: datetime | None = None
    interruptions: list[Interruption] = Field(default_factory=list)
    interruption_count: int = 0  # failures; preemptions are counted apart (their items are in `interruptions`)
    recovery_s: float = 0.0
    preemptions: int = 0
    preemption_lost_s: float = 0.0
    metrics_path: str | None = None
    nights: list[NightRecord] = Field(default_factory=list)

    @property
    def verified(self) -> bool:
        """Succeeded, at least one gate ran (a run whose every gate was skipped proves nothing), and every gate
        passed."""
        return self.status == "succeeded" and bool(gated(self.verdicts)) and all(v.passed for v in self.verdicts)

    @model_validator(mode="after")
    def _family_of_name(self) -> Self:
        """A row or caller that names no family gets its model name's (`llama2-70b` → `llama2`)."""
        self.family = self.family or model_family(self.model)
        return self
