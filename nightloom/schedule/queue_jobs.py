"""Deprecated alias of `nightloom.queue.jobs` for one release: importing it warns."""

from __future__ import annotations

import warnings

from nightloom.queue.jobs import QueuedJob, QueueRefused, job_figures, refusals, spec_refusals

JobFigures = QueuedJob  # the queue's one job record: a job not yet added has id 0

warnings.warn(
    "nightloom.schedule.queue_jobs is deprecated and goes in the next release: import from nightloom.queue.jobs",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["JobFigures", "QueueRefused", "QueuedJob", "job_figures", "refusals", "spec_refusals"]
