"""The planner's calibration from the ledger: the median measured/predicted MFU of verified runs on one GPU type and
model family scales the planner's efficiency factor, within bounds (not on CPU, where the planner predicts no MFU).
`nightloom.ledger.calibration_for_spec` reads it for a spec (tasks/plan.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from nightloom.ledger.records import RunRecord
from nightloom.records import Record


class Calibration(Record):
    """measured/predicted MFU of past verified runs: the factor the planner multiplies its prediction by."""

    gpu_type: str
    model_family: str
    factor: float
    raw_median: float
    runs: int
    clipped: bool


def calibrate(
    runs: Iterable[RunRecord],
    gpu_type: str,
    model_family_: str,
    *,
    lo: float = 0.25,
    hi: float = 1.5,
    min_runs: int = 1,
) -> Calibration | None:
    """Median measured/predicted MFU over the verified runs among `runs` on `gpu_type` of `model_family_`, clipped
    to [lo, hi] so one odd run cannot swing the planner. None with fewer than `min_runs` usable runs."""
    ratios = [
        r.measured_mfu / r.predicted_mfu
        for r in runs
        if r.verified
        and r.gpu_type == gpu_type
        and r.family == model_family_
        and r.measured_mfu
        and r.predicted_mfu
        and r.predicted_mfu > 0
    ]
    if len(ratios) < min_runs or not ratios:
        return None
    raw = statistics.median(ratios)
    factor = min(hi, max(lo, raw))
    return Calibration(
        gpu_type=gpu_type,
        model_family=model_family_,
        factor=factor,
        raw_median=raw,
        runs=len(ratios),
        clipped=factor != raw,
    )
