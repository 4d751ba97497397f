"""XTuner's steps to the run's trackers (the spec's `track`), under the names a native run gives them: each step
mmengine logs becomes the step reporter's StepRecord (`step_record`), and the same TrackerSinks a native rank 0
subscribes (nightloom.track.attempt) take it. XTuner runs in an environment of its own, without nightloom or the
trackers' clients, so its steps are read here: from the launches' vis_data/scalars.json while it trains (live),
then from metrics.jsonl at its end, so each tracker ends with exactly metrics.jsonl's values (a step a relaunch
redid is sent again with the later launch's figures, as metrics.jsonl keeps it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from nightloom.finetune.logs import RunShape, XTunerLogError, collect_steps
from nightloom.metrics import StepMetrics
from nightloom.spec.tracking import TrackSpec
from nightloom.track.attempt import AttemptTrackers, attach_trackers
from nightloom.track.records import TrackerStatus
from nightloom.train.reporting import StepRecord, StepReporter, same_figures

POLL_S = 2.0


def step_record(m: StepMetrics, total_steps: int, world_size: int, now: float) -> StepRecord:
    """The StepRecord of one logged XTuner step; what mmengine does not log (label tokens, HFU, collective
    latency) is None, never a made-up figure. `now`: the step's wall time when its log has none."""
    return StepRecord(
        **same_figures(m),
        total_steps=total_steps,
        peak_mem_bytes=m.peak_mem_bytes,
        local_mem_bytes=m.peak_mem_bytes,
        time=m.time if m.time is not None else now,
        world_size=m.world_size or world_size,
        collective_latency_s=None,
    )


def _figures(m: StepMetrics) -> tuple:
    """What tells a redone step from the one already sent."""
    return (m.loss, m.lr, m.grad_norm, m.step_time_s, m.peak_mem_bytes)


class XTunerStepFeed:
    """Rank 0's tracker sinks for an XTuner run, fed from its logs (see the module's text). `poll` sends the steps
    logged since the last call; `finish(steps)` sends what metrics.jsonl holds that the trackers do not yet have,
    then closes them (their statuses go to tracking.json, as a native attempt's)."""

    def __init__(
        self, trackers: AttemptTrackers, reporter: StepReporter, work_dir: str | Path, shape: RunShape, total_steps: int
    ) -> None:
        self.trackers, self.reporter, self.work_dir, self.shape = trackers, reporter, Path(work_dir), shape
        self.total_steps = total_steps
        self.sent: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.final: list[StepMetrics] | None = None  # metrics.jsonl's steps, once training wrote them

    def emit(self, steps: Iterable[StepMetrics]) -> int:
        """Send each step not sent yet, or sent with other figures (a relaunch redid it); how many were sent."""
        n = 0
        with self._lock:
            for m in steps:
                if self.sent.get(m.step) == _figures(m):
                    continue
                self.reporter.emit(step_record(m, self.total_steps, self.shape.n_devices, time.time()))
                self.sent[m.step] = _figures(m)
                n += 1
        return n

    def poll(self) -> int:
        """The steps the launches logged so far (a log being written, or not there yet, is read next time)."""
        try:
            steps = collect_steps(self.work_dir, self.shape)
        except (XTunerLogError, OSError, ValueError):
            return 0
        return self.emit(steps)

    def start(self, every_s: float = POLL_S) -> XTunerStepFeed:
        """Poll from a background thread every `every_s` seconds until `finish`."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                self.poll()

        self._thread = threading.Thread(target=loop, name="nightloom-xtuner-steps", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> list[TrackerStatus]:
        """Stop polling; send `final` (metrics.jsonl's steps, when training got that far), else what the logs hold;
        close the trackers within track.flush_s and return what each delivered or lost."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.final is None:
            self.poll()
        else:
            self.emit(self.final)
        return self.trackers.close()


@contextmanager
def fed_trackers(
    track: TrackSpec, run_dir: str | Path, run_name: str, work_dir: str | Path, shape: RunShape, total_steps: int
) -> Iterator[XTunerStepFeed | None]:
    """The run's feed, polling while the block runs and finished when it ends, however it ends (set its `final`
    to metrics.jsonl's steps inside); None when the spec turns no tracker on."""
    reporter = StepReporter()
    trackers = attach_trackers(reporter, track, run_dir, run_name, rank=0)
    if trackers is None:
        yield None
        return
    feed = XTunerStepFeed(trackers, reporter, work_dir, shape, total_steps).start()
    try:
        yield feed
    finally:
        feed.finish()
