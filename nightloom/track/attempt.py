"""Rank 0's trackers for one training attempt: one TrackerSink per tracker the spec turns on, subscribed to the
step reporter; each run's id goes to tracking.json as soon as it is open (a relaunched attempt and the flow resume
the same run), and closing gives them track.flush_s together and records what each delivered or lost."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from nightloom.spec.tracking import TrackSpec
from nightloom.track.records import TrackerStatus, TrackingFile, scrub
from nightloom.track.sink import TrackerRun, TrackerSink


def tracker_run(name: str, track: TrackSpec, run_dir: str | Path, run_name: str, run_id: str | None) -> TrackerRun:
    """The client of tracker `name` for this run (resuming `run_id` when one is known)."""
    if name == "mlflow":
        from nightloom.track.mlflow_run import MLflowRun

        return MLflowRun(track.mlflow, run_name, run_id)
    if name == "wandb":
        from nightloom.track.wandb_run import WandbRun

        return WandbRun(track.wandb, run_name, run_dir, run_id)
    from nightloom.track.tensorboard_run import TensorBoardRun

    return TensorBoardRun(track.tensorboard, run_dir)


class AttemptTrackers:
    """The sinks of one attempt (rank 0 only) and their tracking.json."""

    def __init__(self, track: TrackSpec, run_dir: str | Path, run_name: str):
        self.track, self.run_dir = track, Path(run_dir)
        self._lock = threading.Lock()
        self.file = TrackingFile.load(self.run_dir)
        self.sinks: list[TrackerSink] = []
        self.broken: list[TrackerStatus] = []  # trackers whose client could not even be made
        for name in track.enabled():
            try:
                run = tracker_run(name, track, self.run_dir, run_name, self.file.runs.get(name))
            except Exception as e:
                self.broken.append(TrackerStatus(tracker=name, error=scrub(f"{type(e).__name__}: {e}")))
                continue
            self.sinks.append(TrackerSink(run, on_open=self._opened))

    def _opened(self, tracker: str, run_id: str) -> None:
        with self._lock:
            self.file.runs[tracker] = run_id
            self.file.save(self.run_dir)

    def close(self) -> list[TrackerStatus]:
        """Flush every sink at once within track.flush_s; the statuses (lost rows included), also saved."""
        deadline = time.monotonic() + self.track.flush_s
        for s in self.sinks:
            s.begin_close()
        statuses = [s.close(max(0.0, deadline - time.monotonic())) for s in self.sinks] + self.broken
        steps = max((st.sent + st.lost for st in statuses), default=0)
        for st in self.broken:  # a tracker that never started lost every step
            st.lost = steps
        with self._lock:
            self.file.attempts.append(statuses)
            self.file.save(self.run_dir)
        return statuses


def attach_trackers(reporter, track: TrackSpec, run_dir: str | Path, run_name: str, rank: int):
    """Rank 0's AttemptTrackers, each sink added to the trainer's step reporter; None elsewhere or with none on."""
    if rank != 0 or not track.enabled():
        return None
    trackers = AttemptTrackers(track, run_dir, run_name)
    for sink in trackers.sinks:
        reporter.add(sink)
    return trackers
