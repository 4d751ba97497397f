"""Deprecated alias of `nightloom.gates` (the run's gates: MFU, convergence, held-out loss, golden curve) for one
release: importing it warns. `nightloom validate` checks a spec; the gates judge a run."""

from __future__ import annotations

import warnings

from nightloom.gates import (
    GoldenCurve,
    MfuInputs,
    MfuReport,
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
    gated,
    load_golden,
    measure_mfu,
    mfu_inputs,
    require_passed,
    resolve_golden,
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
