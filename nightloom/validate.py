"""Deprecated alias of `nightloom.gates` (the run's gates: MFU, convergence, held-out loss, golden curve) for one
release: importing it warns. `nightloom validate` checks a spec; the gates judge a run. The peak and MFU names the
old module handed out (nightloom.perf's) it hands out still."""

from __future__ import annotations

import warnings

from nightloom.gates import (
    GoldenCurve,
    MfuInputs,
    MfuReport,
    Peak,
    PeakError,
    PeakMeasurement,
    ValidationFailed,
    Verdict,
    check_eval,
    check_finite,
    check_golden,
    check_grad_norm,
    check_loss_drop,
    check_mfu,
    check_spikes,
    failed,
    flops_per_token,
    gated,
    load_golden,
    measure_mfu,
    mfu,
    mfu_inputs,
    require_passed,
    resolve_golden,
    resolve_peak,
    resolve_precision,
    steady_state,
    theil_sen,
    validate_run,
    verdict_label,
)

warnings.warn(
    "nightloom.validate is deprecated and goes in the next release: import from nightloom.gates",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "Peak",
    "PeakError",
    "PeakMeasurement",
    "flops_per_token",
    "mfu",
    "resolve_peak",
    "resolve_precision",
    "GoldenCurve",
    "MfuInputs",
    "MfuReport",
    "ValidationFailed",
    "Verdict",
    "check_eval",
    "check_finite",
    "check_golden",
    "check_grad_norm",
    "check_loss_drop",
    "check_mfu",
    "check_spikes",
    "failed",
    "gated",
    "load_golden",
    "measure_mfu",
    "mfu_inputs",
    "require_passed",
    "resolve_golden",
    "steady_state",
    "theil_sen",
    "validate_run",
    "verdict_label",
]
