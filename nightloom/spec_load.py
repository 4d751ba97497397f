"""Deprecated alias of `nightloom.spec.load` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.spec.load import MOVED, SpecError, coerce_spec, format_errors, load_spec, parse_spec

warnings.warn(
    "nightloom.spec_load is deprecated and goes in the next release: import from nightloom.spec.load",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["MOVED", "SpecError", "coerce_spec", "format_errors", "load_spec", "parse_spec"]
