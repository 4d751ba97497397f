"""Off-peak windows, the run-now/wait/split decision, cost with window discounts, budgets, rent vs buy.

Windows are daily local times in the schedule's time zone (zoneinfo): a window whose end is not after its
start crosses midnight. Each occurrence is turned into UTC instants, so durations are real elapsed time on
daylight-saving days (a 01:00–05:00 window lasts 5 h on the night clocks fall back). A local start that does
not exist (skipped by a spring-forward) resolves as zoneinfo does for fold=0: shifted by the jump.
Every function takes the current time as an argument (an injected clock); none reads the wall clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Literal
from zoneinfo import ZoneInfo

from nightloom.spec import ScheduleSpec

HOURS_PER_MONTH = 730.0  # 8760 / 12


class ScheduleError(ValueError):
    """A schedule question that has no answer (naive datetime, no windows for a windowed policy...)."""


class BudgetExceeded(RuntimeError):
    """The predicted cost of a run is above the spec's budget; the message gives both figures."""


@dataclass(frozen=True)
class Interval:
    """One concrete window occurrence, [start, end) as aware UTC datetimes."""

    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def _aware(now: datetime, what: str = "now") -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ScheduleError(f"{what} must be timezone-aware, got naive {now.isoformat()}")
    return now.astimezone(UTC)


def _hhmm(s: str) -> time:
    h, m = s.split(":")
    return time(int(h), int(m))


def occurrences(schedule: ScheduleSpec, day: date) -> list[Interval]:
    """The windows that start on local date `day`, in UTC (a midnight-crossing one ends the next day)."""
    tz = ZoneInfo(schedule.timezone)
    out = []
    for w in schedule.windows:
        s, e = _hhmm(w.start), _hhmm(w.end)
        start = datetime.combine(day, s, tzinfo=tz)
        end = datetime.combine(day + timedelta(days=1) if e <= s else day, e, tzinfo=tz)
        out.append(Interval(start.astimezone(UTC), end.astimezone(UTC)))
    return out


def windows_between(schedule: ScheduleSpec, start: datetime, end: datetime) -> list[Interval]:
    """Window occurrences overlapping [start, end), merged where they touch or overlap, in order."""
    start, end = _aware(start, "start"), _aware(end, "end")
    tz = ZoneInfo(schedule.timezone)
    d0 = start.astimezone(tz).date() - timedelta(days=1)
    d1 = end.astimezone(tz).date() + timedelta(days=1)
    raw: list[Interval] = []
    d = d0
    while d <= d1:
        raw += [iv for iv in occurrences(schedule, d) if iv.end > start and iv.start < end and iv.end > iv.start]
        d += timedelta(days=1)
    raw.sort(key=lambda iv: iv.start)
    merged: list[Interval] = []
    for iv in raw:
        if merged and iv.start <= merged[-1].end:
            if iv.end > merged[-1].end:
                merged[-1] = Interval(merged[-1].start, iv.end)
        else:
            merged.append(iv)
    return merged


def current_window(schedule: ScheduleSpec, now: datetime) -> Interval | None:
    """The (merged) window containing `now`, or None."""
    now = _aware(now)
    for iv in windows_between(schedule, now - timedelta(days=2), now + timedelta(days=2)):
        if iv.start <= now < iv.end:
            return iv
    return None


def next_window(schedule: ScheduleSpec, now: datetime) -> Interval:
    """The first (merged) window starting strictly after `now`."""
    now = _aware(now)
    if not schedule.windows:
        raise ScheduleError("schedule.windows is empty")
    for iv in windows_between(schedule, now, now + timedelta(days=3)):
        if iv.start > now:
            return iv
    raise ScheduleError(f"no window starts within 3 days of {now.isoformat()} (windows cover the whole day)")


# ---------------------------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class WindowDecision:
    """What the gate does: `run` now (maybe with a checkpoint `deadline`) or `wait` until `start_at`."""

    action: Literal["run", "wait"]
    policy: str
    reason: str
    now: datetime
    start_at: datetime  # == now when action is "run"
    deadline: datetime | None = None  # split: checkpoint and stop here (the window end)
    window: Interval | None = None  # the window the run starts in, if any
    predicted_end: datetime | None = None  # start_at + predicted duration (ignoring splits)

    @property
    def wait_s(self) -> float:
        return (self.start_at - self.now).total_seconds()


def decide(now: datetime, schedule: ScheduleSpec, predicted_duration_s: float) -> WindowDecision:
    """The off-peak gate. `run-now`: always run. `wait`: run inside a window when the run fits in what is left
    of it, else wait for the next window start (a run longer than any window starts at a window start, or now
    if already inside one). `split`: run inside a window with the window end as the checkpoint deadline,
    else wait for the next window start."""
    now = _aware(now)
    if predicted_duration_s < 0 or not math.isfinite(predicted_duration_s):
        raise ScheduleError(f"predicted_duration_s must be finite and >= 0, got {predicted_duration_s}")
    dur = timedelta(seconds=predicted_duration_s)
    pol = schedule.policy
    if pol == "run-now":
        win = current_window(schedule, now) if schedule.windows else None
        where = "inside" if win else "outside"
        return WindowDecision(
            "run", pol, f"policy run-now: starting now ({where} the off-peak window)", now, now, None, win, now + dur
        )
    if not schedule.windows:
        raise ScheduleError(f"policy {pol!r} needs at least one window in schedule.windows")
    win = current_window(schedule, now)
    fmt = _fmt(schedule)
    try:
        nxt = next_window(schedule, now)
    except ScheduleError:  # windows cover the whole day: there is no "next start"
        assert win is not None
        return WindowDecision(
            "run", pol, f"policy {pol}: the windows cover the whole day; starting now", now, now, None, win, now + dur
        )
    if pol == "split":
        if win is not None:
            fits = now + dur <= win.end
            why = "fits before it" if fits else "will checkpoint there and resume in the next window"
            return WindowDecision(
                "run",
                pol,
                f"policy split: inside the window until {fmt(win.end)}; {why}",
                now,
                now,
                win.end,
                win,
                now + dur,
            )
        return WindowDecision(
            "wait",
            pol,
            f"policy split: outside the window; next starts {fmt(nxt.start)}",
            now,
            nxt.start,
            None,
            nxt,
            nxt.start + dur,
        )
    # wait
    if win is not None and now + dur <= win.end:
        return WindowDecision(
            "run",
            pol,
            f"policy wait: inside the window; the run ({_h(dur)}) ends before {fmt(win.end)}",
            now,
            now,
            None,
            win,
            now + dur,
        )
    longest = max(_longest_window(schedule, now), nxt.seconds)
    if win is not None and dur.total_seconds() > longest:
        return WindowDecision(
            "run",
            pol,
            f"policy wait: the run ({_h(dur)}) is longer than any window "
            f"({_h(timedelta(seconds=longest))}); starting now, inside the window, it overruns "
            f"{fmt(win.end)}",
            now,
            now,
            None,
            win,
            now + dur,
        )
    if win is not None:
        reason = (
            f"policy wait: the run ({_h(dur)}) does not fit in what is left of this window (ends "
            f"{fmt(win.end)}); next window starts {fmt(nxt.start)}"
        )
    else:
        reason = f"policy wait: outside the off-peak window; next starts {fmt(nxt.start)}"
    return WindowDecision("wait", pol, reason, now, nxt.start, None, nxt, nxt.start + dur)


def _longest_window(schedule: ScheduleSpec, now: datetime) -> float:
    return max((iv.seconds for iv in windows_between(schedule, now, now + timedelta(days=2))), default=0.0)


def _fmt(schedule: ScheduleSpec):
    tz = ZoneInfo(schedule.timezone)
    return lambda t: t.astimezone(tz).strftime("%Y-%m-%d %H:%M %Z")


def _h(d: timedelta) -> str:
    return f"{d.total_seconds() / 3600:.2f} h"


# ---------------------------------------------------------------------------------------------- cost


@dataclass(frozen=True)
class CostSegment:
    start: datetime
    end: datetime
    offpeak: bool
    gpu_hours: float
    cost: float


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


def _rates(schedule: ScheduleSpec, gpus: int) -> tuple[float, float]:
    """Cost per second (peak, off-peak) for `gpus` GPUs."""
    peak = gpus * schedule.price_per_gpu_hour / 3600.0
    return peak, peak * (1.0 - schedule.offpeak_discount)


def _segments(schedule: ScheduleSpec, start: datetime, end: datetime, gpus: int) -> list[CostSegment]:
    """[start, end) cut at window edges, each piece priced peak or off-peak."""
    peak_rate, off_rate = _rates(schedule, gpus)
    segs: list[CostSegment] = []
    t = start
    for iv in windows_between(schedule, start, end) if end > start and schedule.windows else []:
        a, b = max(iv.start, start), min(iv.end, end)
        if a > t:
            segs.append(_seg(t, a, False, gpus, peak_rate))
        segs.append(_seg(a, b, True, gpus, off_rate))
        t = b
    if end > t:
        segs.append(_seg(t, end, False, gpus, peak_rate))
    return segs


def _seg(a: datetime, b: datetime, off: bool, gpus: int, rate: float) -> CostSegment:
    secs = (b - a).total_seconds()
    return CostSegment(a, b, off, gpus * secs / 3600.0, rate * secs)


def estimate_cost(
    schedule: ScheduleSpec, start: datetime, duration_s: float, gpus: int, provisioning_s: float = 0.0
) -> CostEstimate:
    """Cost of renting `gpus` GPUs from `start` for provisioning_s + duration_s (rented nodes bill while they
    boot). Each second is priced peak or off-peak by the window it falls in."""
    start = _aware(start, "start")
    if gpus <= 0 or duration_s < 0 or provisioning_s < 0:
        raise ScheduleError(f"gpus ({gpus}) must be > 0 and durations ({duration_s}, {provisioning_s}) >= 0")
    end = start + timedelta(seconds=provisioning_s + duration_s)
    segs = _segments(schedule, start, end, gpus)
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


def cost_of_spans(schedule: ScheduleSpec, spans: list[BillingSpan]) -> float:
    """Sum of estimate_cost over spans, each priced by the windows it falls in at its own GPU count."""
    return sum(estimate_cost(schedule, s.start, max(0.0, s.seconds), s.gpus).cost for s in spans if s.gpus > 0)


def check_budget(schedule: ScheduleSpec, estimate: CostEstimate) -> None:
    """Refuse a run whose predicted cost exceeds schedule.budget (no budget = no limit)."""
    if schedule.budget is not None and estimate.cost > schedule.budget:
        raise BudgetExceeded(
            f"predicted cost {estimate.cost:,.2f} {estimate.currency} ({estimate.gpu_hours:,.2f} GPU-hours, "
            f"{estimate.offpeak_gpu_hours:,.2f} off-peak) exceeds schedule.budget {schedule.budget:,.2f} "
            f"{schedule.currency}"
        )


def budget_deadline(
    schedule: ScheduleSpec, start: datetime, gpus: int, already_spent: float = 0.0, max_days: int = 366
) -> datetime | None:
    """When a run that started billing at `start` on `gpus` GPUs will have spent schedule.budget (less
    `already_spent`): the trainer's stop-with-checkpoint deadline. None without a budget or at price 0."""
    start = _aware(start, "start")
    if schedule.budget is None or schedule.price_per_gpu_hour == 0:
        return None
    left = schedule.budget - already_spent
    if left <= 0:
        return start
    t = start
    while t < start + timedelta(days=max_days):
        chunk_end = t + timedelta(days=7)
        for seg in _segments(schedule, t, chunk_end, gpus):
            if seg.cost >= left:
                rate = seg.cost / (seg.end - seg.start).total_seconds()
                return seg.start + timedelta(seconds=left / rate)
            left -= seg.cost
        t = chunk_end
    return None


# ---------------------------------------------------------------------------------------------- rent vs buy


@dataclass(frozen=True)
class RentVsBuy:
    """Monthly cost of renting the GPU-hours a team uses vs owning a cluster of the same size.

    Owning: purchase price amortised over `amortisation_months` + operations per month (power, space, staff);
    only (1 − idle_fraction) of the owned hours are useful. Buying takes lead_time_days to arrive, during
    which the team rents anyway."""

    gpus: int
    gpu_hours_per_month: float
    rent_price_per_gpu_hour: float  # blended: off-peak share discounted
    rent_per_month: float
    purchase_price: float | None
    amortisation_months: int
    operations_per_month: float
    idle_fraction: float
    own_per_month: float | None
    own_useful_gpu_hours: float
    own_per_useful_gpu_hour: float | None
    break_even_gpu_hours_per_month: float | None  # renting beyond this costs more than owning
    break_even_purchase_price: float | None  # owning is cheaper below this price at this usage
    lead_time_days: tuple[int, int]
    lead_time_rent: tuple[float, float]
    currency: str
    cheaper: Literal["rent", "buy", "unknown"]
    over_capacity: bool  # the usage needs more than the owned cluster's useful hours


def rent_vs_buy(
    *,
    gpus: int,
    gpu_hours_per_month: float,
    rent_price_per_gpu_hour: float,
    purchase_price: float | None = None,
    amortisation_months: int = 36,
    operations_per_month: float = 28_000.0,
    idle_fraction: float = 0.37,
    lead_time_days: tuple[int, int] = (45, 90),
    currency: str = "USD",
) -> RentVsBuy:
    """Compare renting with a self-built cluster. Defaults are the figures commonly quoted for small teams:
    28,000/month operations, 37% idle, 45–90 days from order to running hardware."""
    if gpus <= 0 or gpu_hours_per_month < 0 or rent_price_per_gpu_hour < 0 or amortisation_months <= 0:
        raise ValueError("gpus and amortisation_months must be > 0; hours and prices >= 0")
    if not 0 <= idle_fraction < 1:
        raise ValueError(f"idle_fraction must be in [0, 1), got {idle_fraction}")
    rent = gpu_hours_per_month * rent_price_per_gpu_hour
    useful = gpus * HOURS_PER_MONTH * (1 - idle_fraction)
    own = None if purchase_price is None else purchase_price / amortisation_months + operations_per_month
    per_useful = None if own is None else own / useful
    be_hours = None if own is None or rent_price_per_gpu_hour == 0 else own / rent_price_per_gpu_hour
    be_price = max(0.0, (rent - operations_per_month) * amortisation_months)
    per_day = rent / (HOURS_PER_MONTH / 24)
    cheaper: Literal["rent", "buy", "unknown"] = "unknown" if own is None else ("buy" if own < rent else "rent")
    return RentVsBuy(
        gpus=gpus,
        gpu_hours_per_month=gpu_hours_per_month,
        rent_price_per_gpu_hour=rent_price_per_gpu_hour,
        rent_per_month=rent,
        purchase_price=purchase_price,
        amortisation_months=amortisation_months,
        operations_per_month=operations_per_month,
        idle_fraction=idle_fraction,
        own_per_month=own,
        own_useful_gpu_hours=useful,
        own_per_useful_gpu_hour=per_useful,
        break_even_gpu_hours_per_month=be_hours,
        break_even_purchase_price=be_price,
        lead_time_days=lead_time_days,
        lead_time_rent=(per_day * lead_time_days[0], per_day * lead_time_days[1]),
        currency=currency,
        cheaper=cheaper,
        over_capacity=gpu_hours_per_month > useful,
    )
