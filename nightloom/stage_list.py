"""Deprecated alias of `nightloom.spec.stage_list` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.spec.stage_list import stage_list_errors

warnings.warn(
    "nightloom.stage_list is deprecated and goes in the next release: import from nightloom.spec.stage_list",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["stage_list_errors"]
