"""Deprecated alias of `nightloom.queue.timetable` for one release: importing it warns. The plan's job is the queue's one record, nightloom.queue.jobs.QueuedJob."""

from __future__ import annotations

import warnings

from nightloom.queue.jobs import FAR, QueuedJob
from nightloom.queue.timetable import PlannedJob, PlannedNight, PlannedSegment, QueuePlan, plan_queue

PlanJob = QueuedJob  # the queue's one job record: its price and discount are now its schedule's

warnings.warn(
    "nightloom.schedule.queue_plan is deprecated and goes in the next release: import from nightloom.queue.timetable",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["FAR", "PlanJob", "PlannedJob", "PlannedNight", "PlannedSegment", "QueuePlan", "QueuedJob", "plan_queue"]
