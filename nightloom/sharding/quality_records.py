"""What the quality filters and near-dup removal report (counts per filter, samples of removed documents): the
records live in manifest.py (a training rank imports only that module of the sharder); named here for the
quality pass."""

from __future__ import annotations

from nightloom.sharding.manifest import QualityCounts, Removed, RemovedSample

__all__ = ["QualityCounts", "Removed", "RemovedSample"]
