"""The files of one run folder (`<storage.root>/<run_id>/`), named in one place.

The orchestrator, the trainer on every rank, the XTuner backend, recovery and teardown all find a run's
files through `RunFiles`, so a name changes here or nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunFiles:
    """Paths inside one run folder."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def metrics(self) -> Path:
        """One JSON line per training step (nightloom.metrics.StepMetrics)."""
        return self.root / "metrics.jsonl"

    @property
    def discarded_metrics(self) -> Path:
        """Metrics lines of steps redone after a recovery (rewound out of `metrics`)."""
        return self.root / "metrics-discarded.jsonl"

    @property
    def result(self) -> Path:
        """The TrainResult rank 0 writes at the end of an attempt."""
        return self.root / "result.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def cluster(self) -> Path:
        """The rented cluster, for teardown hooks that run outside the flow."""
        return self.root / "cluster.json"

    @property
    def processes(self) -> Path:
        """Local process groups of the current launch, for teardown hooks."""
        return self.root / "processes.json"

    @property
    def pids(self) -> Path:
        """One `rank-N.pid` per local rank (written by the trainer)."""
        return self.root / "pids"

    def rank_pid(self, rank: int) -> Path:
        """The pid of one local rank (lets an operator, or a test, find and signal it)."""
        return self.pids / f"rank-{rank}.pid"

    def job(self, attempt: int) -> Path:
        """The TrainJob of one attempt (`--job` of every rank)."""
        return self.root / f"job-attempt{attempt}.json"
