"""Deprecated alias of `nightloom.queue.gantt` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.queue.gantt import plot_queue_gantt

warnings.warn(
    "nightloom.schedule.queue_gantt is deprecated and goes in the next release: import from nightloom.queue.gantt",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["plot_queue_gantt"]
