"""A tracker as a step sink (nightloom.train.reporting.StepSink): `emit` only appends the step's values to a buffer
and never waits on the network; a background thread opens the tracker's run and sends the buffer in batches,
retrying with backoff while the tracker is down or slow; `close(flush_s)` gives it that long to take the rest and
says what it never got (TrackerStatus: sent, lost and their steps, failed tries), so nothing is dropped silently."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from nightloom.track.records import TrackerStatus, scrub, step_ranges
from nightloom.train.reporting import StepRecord

#: the StepRecord figures a tracker gets (None ones are left out of that step)
STEP_FIELDS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "label_tokens_per_s",
    "step_time_s",
    "mfu",
    "hfu",
    "peak_mem_bytes",
    "eval_loss",
    "eval_ppl",
    "router_aux_loss",
)


@dataclass(frozen=True)
class StepValues:
    """One step's figures as a tracker takes them: the step, its wall time (s since the epoch), name -> value."""

    step: int
    time: float
    values: dict[str, float]


def step_values(r: StepRecord) -> StepValues:
    values = {k: float(getattr(r, k)) for k in STEP_FIELDS if getattr(r, k) is not None}
    values |= {k: float(v) for k, v in (r.preference or {}).items()}  # dpo and grpo figures, TRL's names
    return StepValues(step=r.step, time=r.time, values=values)


class TrackerRun(Protocol):
    """One tracker's run as the sink drives it (nightloom.track.mlflow_run, wandb_run, tensorboard_run)."""

    name: str
    where: str

    def open(self) -> str:
        """Create the run, or resume the one whose id it was given; its id."""
        ...

    def log_metrics(self, rows: list[StepValues]) -> None: ...

    def close(self) -> None:
        """Flush what the client itself holds (the run stays open for the flow's end-of-run logging)."""
        ...


class TrackerSink:
    """Buffers each step for one tracker and delivers it from a background thread (see the module's text)."""

    def __init__(
        self,
        run: TrackerRun,
        *,
        on_open: Callable[[str, str], None] | None = None,
        batch: int = 500,
        backoff_s: tuple[float, float] = (0.2, 5.0),
    ) -> None:
        self.run, self.batch, self.backoff_s, self.on_open = run, batch, backoff_s, on_open
        self.status = TrackerStatus(tracker=run.name, where=run.where)
        self._pending: deque[StepValues] = deque()
        self._cv = threading.Condition()
        self._closing = self._stop = self._opened = False
        self._thread = threading.Thread(target=self._loop, name=f"nightloom-track-{run.name}", daemon=True)
        self._thread.start()

    def emit(self, record: StepRecord) -> None:
        with self._cv:
            self._pending.append(step_values(record))
            self._cv.notify()

    def _next_batch(self) -> list[StepValues] | None:
        """The rows to send next; None when closing with nothing left (or stopped)."""
        with self._cv:
            self._cv.wait_for(lambda: self._pending or self._closing or self._stop or not self._opened)
            if self._stop or (self._closing and not self._pending and self._opened):
                return None
            return list(islice(self._pending, self.batch))

    def _deliver(self, batch: list[StepValues]) -> None:
        if not self._opened:
            self.status.run_id = self.run.open()
            self._opened = True
            if self.on_open is not None:
                self.on_open(self.run.name, self.status.run_id)
        if batch:
            self.run.log_metrics(batch)

    def _loop(self) -> None:
        delay = self.backoff_s[0]
        while (batch := self._next_batch()) is not None:
            try:
                self._deliver(batch)
            except Exception as e:  # a tracker down or slow never reaches training: retried, then reported
                self.status.failures += 1
                self.status.error = scrub(f"{type(e).__name__}: {e}")[:500]
                with self._cv:
                    self._cv.wait_for(lambda: self._stop, timeout=delay)
                delay = min(delay * 2, self.backoff_s[1])
                continue
            delay = self.backoff_s[0]
            with self._cv:
                if not self._stop:  # after a stop the rows left were already counted lost
                    for _ in batch:
                        self._pending.popleft()
                    self.status.sent += len(batch)
        if self._opened and not self._stop:
            try:
                self.run.close()
            except Exception as e:
                self.status.error = scrub(f"closing: {type(e).__name__}: {e}")[:500]

    def begin_close(self) -> None:
        """No more rows are coming: the thread sends what is left, then closes the run."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()

    def close(self, flush_s: float) -> TrackerStatus:
        """Let the thread deliver what is buffered for up to `flush_s` seconds, then stop it; the status says how
        many rows (and which steps) the tracker never got."""
        self.begin_close()
        self._thread.join(flush_s)
        with self._cv:
            self._stop = True
            lost = list(self._pending)
            self._pending.clear()
            self._cv.notify_all()
        self._thread.join(0.5)  # a thread stuck in a request is a daemon: left behind, its rows counted lost
        status = self.status.model_copy(deep=True)
        status.lost, status.lost_steps = len(lost), step_ranges([v.step for v in lost])
        if lost and status.error is None:
            status.error = f"not delivered within track.flush_s ({flush_s:g} s)"
        return status
