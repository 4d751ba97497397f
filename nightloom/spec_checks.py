"""Deprecated alias of `nightloom.spec.checks` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.spec.checks import TRAINED_MOE, semantic_errors

warnings.warn(
    "nightloom.spec_checks is deprecated and goes in the next release: import from nightloom.spec.checks",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["TRAINED_MOE", "semantic_errors"]
