"""Deprecated alias of `nightloom.spec.cluster` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.spec import cluster
from nightloom.spec.cluster import *  # noqa: F403 - the names of cluster.__all__, listed there once

warnings.warn(
    "nightloom.spec_cluster is deprecated and goes in the next release: import from nightloom.spec.cluster",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = cluster.__all__
