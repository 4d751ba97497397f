"""Deprecated alias of `nightloom.spec.micro_batch` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.spec.micro_batch import micro_batches_per_step

warnings.warn(
    "nightloom.micro_batch is deprecated and goes in the next release: import from nightloom.spec.micro_batch",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["micro_batches_per_step"]
