"""Deprecated alias of `nightloom.queue.store` for one release: importing it warns. QueuedJob and QueueRefused are nightloom.queue.jobs'."""

from __future__ import annotations

import warnings

from nightloom.queue.jobs import QueuedJob, QueueRefused
from nightloom.queue.store import QueueError, QueueRecord, QueueRun, QueueStore, queue_metadata

warnings.warn(
    "nightloom.queue_store is deprecated and goes in the next release: import from nightloom.queue.store",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["QueueError", "QueueRecord", "QueueRefused", "QueueRun", "QueueStore", "QueuedJob", "queue_metadata"]
