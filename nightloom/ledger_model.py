"""Deprecated alias of `nightloom.ledger.model` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.ledger.model import RunModel, ledger_fields, model_family, run_model, run_model_from_job, spec_run_model

warnings.warn(
    "nightloom.ledger_model is deprecated and goes in the next release: import from nightloom.ledger.model",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["RunModel", "ledger_fields", "model_family", "run_model", "run_model_from_job", "spec_run_model"]
