"""The validate section: the gates a run must pass (MFU, convergence, held-out loss, a golden curve, benchmarks).

A leaf of the spec package (floor 0): it imports only the section base.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from nightloom.spec.base import Section as _Section
from nightloom.spec.benchmarks import BenchmarksSpec


class GoldenSpec(_Section):
    path: str | None = Field(None, description="JSONL of {step, loss}; or use `from_ledger`.")
    from_ledger: bool = Field(False, description="Golden losses: the ledger's best verified run of this spec.")
    rtol: float = Field(0.05, gt=0, description="Allowed relative difference from the golden loss.")


class ValidateSpec(_Section):
    """Gates a run must pass; a failing gate fails the flow with its reason."""

    mfu_floor: float = Field(0.0, ge=0, lt=1, description="Minimum measured MFU (0 = no floor).")
    mfu_vs_plan: float = Field(0.0, ge=0, le=2, description="Measured MFU >= this fraction of the planned MFU.")
    min_loss_drop: float = Field(0.05, ge=0, lt=1, description="Fitted loss must fall by this fraction.")
    window: int = Field(0, ge=0, description="Steps in the convergence window (0 = whole run).")
    spike_k: float = Field(8.0, gt=0, description="A spike is a loss above k × MAD of the trend.")
    spike_min_rise: float = Field(0.25, ge=0, description="... and above the trailing median by this fraction.")
    spike_sustain: int = Field(3, ge=1, description="... for this many consecutive steps (hard batches pass).")
    grad_norm_max: float | None = Field(None, gt=0, description="Gate: no step's gradient norm above this.")
    golden: GoldenSpec = Field(default_factory=GoldenSpec, description="Gate: the losses follow a known curve.")

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

    eval_every: int = Field(0, ge=0, description="Held-out evaluation every K steps and at the end (0 = never).")
    eval_windows: int = Field(16, gt=0, description="Fixed eval windows of seq_len+1 tokens (the first ones).")
    eval_data: str | None = Field(
        None, description="A JSONL file of eval documents (text field as the dataset's); default the held-out split."
    )
    eval_must_fall: bool = Field(True, description="Gate: the last eval loss is below the first.")
    min_reward_accuracy: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Gate (train.task dpo): the last held-out reward accuracy (the share of pairs whose chosen "
        "earns the higher reward) is at least this; needs eval_every.",
    )
    min_reward_gain: float | None = Field(
        None,
        description="Gate (train.task grpo): the held-out prompts' mean reward at the last evaluation minus before "
        "the first step is at least this; needs eval_every.",
    )
    eval_max_rise: float = Field(
        0.05, ge=0, description="Gate: the last eval loss is at most this fraction above the best (overfitting)."
    )
    benchmarks: BenchmarksSpec | None = Field(
        None, description="lm-evaluation-harness tasks on the export and the base, side by side, with their gates."
    )
