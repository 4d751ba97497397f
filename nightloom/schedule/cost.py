"""What rented time costs: GPU-hours × price, discounted inside off-peak windows, cut at the window edges.

A run's time is priced from its billing spans (one per cluster size), provisioning included: rented nodes bill
while they boot. The caller reads the clocks; these functions only price the instants they are given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from nightloom.schedule.errors import ScheduleError
from nightloom.schedule.windows import aware_utc, windows_between
from nightloom.spec import ScheduleSpec


@dataclass(frozen=True)
class CostSegment:
    """A stretch of rented time priced at one rate; `what` names the work (provisioning, training...)."""

    start: datetime
    end: datetime
    offpeak: bool
    gpu_hours: float
    cost: float
    what: str = "rented"


@dataclass(frozen=True)
class CostEstimate:
    """GPU-hours × price, discounted inside windows, provisioning counted; segments split at window edges."""

    gpus: int
    start: datetime
    end: datetime
    provisioning_s: float
    gpu_hours: float
    offpeak_gpu_hours: float
    cost: float
    currency: str
    segments: list[CostSegment] = field(default_factory=list)

    @property
    def peak_gpu_hours(self) -> float:
        return self.gpu_hours - self.offpeak_gpu_hours


def rates_per_s(schedule: ScheduleSpec, gpus: int) -> tuple[float, float]:
    """Cost per second (peak, off-peak) for `gpus` GPUs."""
    peak = gpus * schedule.price_per_gpu_hour / 3600.0
    return peak, peak * (1.0 - schedule.offpeak_discount)


def priced_segments(
    schedule: ScheduleSpec, start: datetime, end: datetime, gpus: int, what: str = "rented"
) -> list[CostSegment]:
    """[start, end) cut at window edges, each piece priced peak or off-peak."""
    peak_rate, off_rate = rates_per_s(schedule, gpus)
    segs: list[CostSegment] = []
    t = start
    for iv in windows_between(schedule, start, end) if end > start and schedule.windows else []:
        a, b = max(iv.start, start), min(iv.end, end)
        if a > t:
            segs.append(_seg(t, a, False, gpus, peak_rate, what))
        segs.append(_seg(a, b, True, gpus, off_rate, what))
        t = b
    if end > t:
        segs.append(_seg(t, end, False, gpus, peak_rate, what))
    return segs


def _seg(a: datetime, b: datetime, off: bool, gpus: int, rate: float, what: str = "rented") -> CostSegment:
    secs = (b - a).total_seconds()
    return CostSegment(a, b, off, gpus * secs / 3600.0, rate * secs, what)


def estimate_cost(
    schedule: ScheduleSpec, start: datetime, duration_s: float, gpus: int, provisioning_s: float = 0.0
) -> CostEstimate:
    """Cost of renting `gpus` GPUs from `start` for provisioning_s + duration_s (rented nodes bill while they
    boot). Each second is priced peak or off-peak by the window it falls in."""
    start = aware_utc(start, "start")
    if gpus <= 0 or duration_s < 0 or provisioning_s < 0:
        raise ScheduleError(f"gpus ({gpus}) must be > 0 and durations ({duration_s}, {provisioning_s}) >= 0")
    end = start + timedelta(seconds=provisioning_s + duration_s)
    segs = priced_segments(schedule, start, end, gpus)
    return CostEstimate(
        gpus=gpus,
        start=start,
        end=end,
        provisioning_s=provisioning_s,
        gpu_hours=sum(s.gpu_hours for s in segs),
        offpeak_gpu_hours=sum(s.gpu_hours for s in segs if s.offpeak),
        cost=sum(s.cost for s in segs),
        currency=schedule.currency,
        segments=segs,
    )


@dataclass(frozen=True)
class BillingSpan:
    """A stretch of rented time at one cluster size (a recovery that shrinks the cluster starts a new span)."""

    start: datetime
    seconds: float
    gpus: int

    @classmethod
    def between(cls, start: datetime, end: datetime, gpus: int) -> BillingSpan:
        """The span from `start` to `end` (the caller reads the clock, so tests can inject both)."""
        return cls(start=start, seconds=max(0.0, (end - start).total_seconds()), gpus=gpus)

    def shifted(self, seconds: float) -> BillingSpan:
        """The same span moved by `seconds` (real clock → a run's injected clock, for pricing)."""
        return BillingSpan(self.start + timedelta(seconds=seconds), self.seconds, self.gpus)


def cost_of_spans(schedule: ScheduleSpec, spans: list[BillingSpan]) -> float:
    """Sum of estimate_cost over spans, each priced by the windows it falls in at its own GPU count."""
    return sum(estimate_cost(schedule, s.start, max(0.0, s.seconds), s.gpus).cost for s in spans if s.gpus > 0)


def run_cost(
    schedule: ScheduleSpec, started: datetime, provisioning_s: float, gpus: int, training: list[BillingSpan]
) -> float:
    """What one stretch of renting cost: provisioning from `started` on the cluster first acquired (nodes bill
    while they boot), then every training span at its own size and window."""
    boot = estimate_cost(schedule, started, 0.0, gpus, provisioning_s=max(0.0, provisioning_s)).cost if gpus else 0.0
    return boot + cost_of_spans(schedule, training)


def lost_time_cost(schedule: ScheduleSpec, at: datetime, seconds: float, gpus: int) -> float:
    """What `seconds` of `gpus` GPUs from `at` cost (an interruption's lost time); 0 for nothing lost."""
    if gpus <= 0 or seconds <= 0:
        return 0.0
    return estimate_cost(schedule, at, seconds, gpus).cost
