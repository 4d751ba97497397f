"""Deprecated alias of `nightloom.spec.cluster` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.spec.cluster import (
    PROVIDER_KINDS,
    ClusterSpec,
    KubernetesSpec,
    LocalSpec,
    NCCLSpec,
    ProviderSpec,
    SlurmSpec,
    SSHHost,
    SSHSpec,
)

warnings.warn(
    "nightloom.spec_cluster is deprecated and goes in the next release: import from nightloom.spec.cluster",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "PROVIDER_KINDS",
    "ClusterSpec",
    "KubernetesSpec",
    "LocalSpec",
    "NCCLSpec",
    "ProviderSpec",
    "SSHHost",
    "SSHSpec",
    "SlurmSpec",
]
