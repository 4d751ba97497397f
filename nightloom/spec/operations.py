"""The operating sections of a run spec: off-peak windows and prices, storage, the ledger, recovery.

A leaf of the spec package (floor 0): it imports only the section base.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from nightloom.spec.base import Section as _Section


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

    timezone: str = Field("Asia/Shanghai", description="IANA time zone of the windows.")
    windows: list[WindowSpec] = Field(default_factory=lambda: [WindowSpec()], description="Off-peak windows.")
    policy: Literal["wait", "run-now", "split"] = Field("run-now", description="Outside a window: run, wait, split.")
    price_per_gpu_hour: float = Field(0.0, ge=0, description="Peak price of one GPU for an hour.")
    offpeak_discount: float = Field(0.18, ge=0, lt=1, description="Discount inside a window (0.18 = 18%).")
    currency: str = Field("USD", description="Currency of the prices and the budget.")
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
    s3_region: str = Field("us-east-1", description="S3 region.")
    credentials_secret: str | None = Field(None, description="Prefect Secret block with 'KEY_ID:SECRET'.")


class LedgerSpec(_Section):
    url: str = Field("sqlite:///.nightloom/ledger.db", description="Any SQLAlchemy URL.")


class RecoverySpec(_Section):
    max_attempts: int = Field(0, ge=0, description="Re-launches after a failure (0 = fail at once).")
    max_minutes: float = Field(30.0, gt=0, description="Time to recover, summed over attempts, before giving up.")
    allow_relayout: bool = Field(True, description="Relaunch on fewer GPUs, re-planned, when nodes are lost.")
    spare_nodes: int = Field(0, ge=0, description="local: extra nodes that replace failed ones (ssh: `spare` hosts).")
    max_preemptions: int = Field(
        10,
        ge=0,
        description="Relaunches after a preemption (SIGTERM or recovery.preempt_signal: every rank saved a "
        "checkpoint at one agreed step), counted apart from max_attempts.",
    )
    preempt_signal: Literal["SIGUSR1", "SIGUSR2"] | None = Field(
        None,
        description="A notice signal handled like SIGTERM (checkpoint at the next step, stop); slurm passes "
        "it as sbatch --signal so it comes recovery.preempt_grace_s before the time limit.",
    )
    preempt_grace_s: int = Field(
        120,
        gt=0,
        description="Seconds a preempted rank has to finish its step and save: slurm's --signal lead, "
        "kubernetes' terminationGracePeriodSeconds, torchrun's shutdown timeout.",
    )
