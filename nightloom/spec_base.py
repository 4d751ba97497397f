"""Deprecated alias of `nightloom.spec.base` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.spec.base import Section, SpecError

warnings.warn(
    "nightloom.spec_base is deprecated and goes in the next release: import from nightloom.spec.base",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["Section", "SpecError"]
