"""Deprecated alias of `nightloom.queue.tonight` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.queue.tonight import (
    JOB_STATUSES,
    JobProgress,
    NightOutcome,
    NightStretch,
    StretchPlacement,
    next_night,
    night_outcome,
    placement,
    remaining,
    tonight,
    tonight_window,
)

warnings.warn(
    "nightloom.schedule.queue_night is deprecated and goes in the next release: import from nightloom.queue.tonight",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "JOB_STATUSES",
    "JobProgress",
    "NightOutcome",
    "NightStretch",
    "StretchPlacement",
    "next_night",
    "night_outcome",
    "placement",
    "remaining",
    "tonight",
    "tonight_window",
]
