"""Off-peak windows, the run-now/wait/split decision, the plan of nights and its cost, budgets, rent vs buy.

Windows are daily local times in the schedule's time zone (zoneinfo): a window whose end is not after its
start crosses midnight. Each occurrence is turned into UTC instants, so durations are real elapsed time on
daylight-saving days (a 01:00–05:00 window lasts 5 h on the night clocks fall back). A local start that does
not exist (skipped by a spring-forward) resolves as zoneinfo does for fold=0: shifted by the jump.
Every function takes the current time as an argument (an injected clock); none reads the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import TYPE_CHECKING, Literal
from zoneinfo import ZoneInfo

from nightloom.catalog import resolve_model
from nightloom.perf import count_params
from nightloom.spec import RunSpec, ScheduleSpec

if TYPE_CHECKING:
    from nightloom.ledger import RunRecord

HOURS_PER_MONTH = 730.0  # 8760 / 12


class ScheduleError(ValueError):
    """A schedule question that has no answer (naive datetime, no windows for a windowed policy...)."""


class RunRefused(RuntimeError):
    """A run refused before anything is rented (over budget, too many nights); the message says why."""


class BudgetExceeded(RunRefused):
    """The predicted cost of a run is above the spec's budget; the message gives both figures."""


class TooManyNights(RunRefused):
    """A run needs more nights than schedule.max_nights; the message gives the number it needs."""


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
    return _fmt_zone(schedule.timezone)


def _h(d: timedelta) -> str:
    return f"{d.total_seconds() / 3600:.2f} h"


# ---------------------------------------------------------------------------------------------- cost


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


def _rates(schedule: ScheduleSpec, gpus: int) -> tuple[float, float]:
    """Cost per second (peak, off-peak) for `gpus` GPUs."""
    peak = gpus * schedule.price_per_gpu_hour / 3600.0
    return peak, peak * (1.0 - schedule.offpeak_discount)


def _segments(
    schedule: ScheduleSpec, start: datetime, end: datetime, gpus: int, what: str = "rented"
) -> list[CostSegment]:
    """[start, end) cut at window edges, each piece priced peak or off-peak."""
    peak_rate, off_rate = _rates(schedule, gpus)
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


# ---------------------------------------------------------------------------------------------- nights

DEFAULT_PROVISIONING_S = 600.0  # 10 min from renting to ready when neither the ledger nor the spec says
STOP_S = 30.0  # after the last checkpoint, up to this long for the processes to exit and the nodes to be released
# A DCP checkpoint holds the fp32 master weights and Adam's m and v: the 12 of the 16 B/param of mixed-precision
# Adam (DESIGN.md "Memory"; the bf16 working copy and the gradients are not saved).
CHECKPOINT_BYTES_PER_PARAM = 12.0
STEP_REL_ERR = {"planner": 0.25, "ledger": 0.10, "given": 0.0, "none": 0.0}  # stated step-time uncertainty
PROVISIONING_REL_ERR = {"ledger": 0.25, "spec": 0.5, "default": 0.5, "given": 0.0}
MAX_PLANNED_NIGHTS = 3660  # ten years of nightly windows: beyond this the plan is refused as endless


@dataclass(frozen=True)
class NightInputs:
    """What a plan of nights is computed from; each figure carries its source (planner, ledger, spec...)."""

    steps: int  # steps left to train
    gpus: int
    step_time_s: float | None  # None: no prediction (CPU without a ledger measurement)
    step_source: str  # "planner" | "ledger" | "given" | "none", then ": detail"
    provisioning_s: float
    provisioning_source: str  # "ledger" | "spec" | "default" | "given", then ": detail"
    checkpoint_s: float  # one save at a window end
    restore_s: float  # one load at a later night's start
    checkpoint_source: str
    resumed: bool = False  # the first night restores a checkpoint too (a continuation)
    steps_done: int = 0  # before the first planned night
    nights_used: int = 0  # nights this run already used (a continuation)
    spent: float = 0.0  # money this run already spent (a continuation)

    def _kind(self, source: str) -> str:
        return source.split(":", 1)[0]

    @property
    def step_rel_err(self) -> float:
        return STEP_REL_ERR.get(self._kind(self.step_source), 0.25)

    @property
    def provisioning_rel_err(self) -> float:
        return PROVISIONING_REL_ERR.get(self._kind(self.provisioning_source), 0.5)


@dataclass(frozen=True)
class Night:
    """One stretch of renting: provisioning, restore, training, and (when a window end cuts it) a checkpoint.
    `steps` is None when no step time is known; `ends_run` is None then too."""

    index: int  # 1-based, counting the nights this run already used
    start: datetime
    end: datetime
    window: Interval | None
    steps: int | None
    ends_run: bool | None
    segments: list[CostSegment]
    uncertainty: float  # ± cost, in the schedule's currency

    @property
    def cost(self) -> float:
        return sum(s.cost for s in self.segments)

    @property
    def gpu_hours(self) -> float:
        return sum(s.gpu_hours for s in self.segments)

    @property
    def offpeak_gpu_hours(self) -> float:
        return sum(s.gpu_hours for s in self.segments if s.offpeak)

    def seconds(self, what: str) -> float:
        return sum((s.end - s.start).total_seconds() for s in self.segments if s.what == what)


@dataclass(frozen=True)
class NightPlan:
    """The nights a run will use under its policy, each priced at the rate of the time it falls in.
    `complete` is False without a step-time prediction: only the first night is planned, as a bound."""

    policy: str
    timezone: str
    currency: str
    inputs: NightInputs
    nights: list[Night]
    complete: bool
    reason: str  # the window decision in words
    note: str = ""

    @property
    def start(self) -> datetime:
        return self.nights[0].start

    @property
    def finish(self) -> datetime | None:
        """When the last night ends (None: unknown, no step-time prediction)."""
        return self.nights[-1].end if self.complete else None

    @property
    def cost(self) -> float:
        return sum(n.cost for n in self.nights)

    @property
    def uncertainty(self) -> float:
        return sum(n.uncertainty for n in self.nights)

    @property
    def gpu_hours(self) -> float:
        return sum(n.gpu_hours for n in self.nights)

    @property
    def offpeak_gpu_hours(self) -> float:
        return sum(n.offpeak_gpu_hours for n in self.nights)

    @property
    def training_s(self) -> float:
        return sum(n.seconds("training") for n in self.nights)

    @property
    def total_nights(self) -> int | None:
        """Nights the whole run uses, counting those already used (None: unknown)."""
        return self.inputs.nights_used + len(self.nights) if self.complete else None

    def local(self, t: datetime | None) -> str:
        """`t` in the schedule's time zone, e.g. '2026-12-03 05:12 CST' ('unknown' for None)."""
        return "unknown" if t is None else _fmt_zone(self.timezone)(t)

    def to_json(self) -> dict:
        """The plan as plain JSON types (the `--json` of `nightloom cost`)."""
        tz = ZoneInfo(self.timezone)

        def iso(t: datetime | None) -> str | None:
            return None if t is None else t.astimezone(tz).isoformat()

        return {
            "policy": self.policy,
            "timezone": self.timezone,
            "currency": self.currency,
            "complete": self.complete,
            "reason": self.reason,
            "note": self.note,
            "inputs": {k: getattr(self.inputs, k) for k in self.inputs.__dataclass_fields__},
            "nights": [
                {
                    "night": n.index,
                    "start": iso(n.start),
                    "end": iso(n.end),
                    "window": None if n.window is None else [iso(n.window.start), iso(n.window.end)],
                    "steps": n.steps,
                    "ends_run": n.ends_run,
                    "cost": n.cost,
                    "uncertainty": n.uncertainty,
                    "gpu_hours": n.gpu_hours,
                    "offpeak_gpu_hours": n.offpeak_gpu_hours,
                    "segments": [
                        {
                            "what": s.what,
                            "start": iso(s.start),
                            "end": iso(s.end),
                            "offpeak": s.offpeak,
                            "gpu_hours": s.gpu_hours,
                            "cost": s.cost,
                        }
                        for s in n.segments
                    ],
                }
                for n in self.nights
            ],
            "totals": {
                "nights": self.total_nights,
                "nights_planned": len(self.nights),
                "start": iso(self.start),
                "finish": iso(self.finish),
                "training_h": self.training_s / 3600.0,
                "gpu_hours": self.gpu_hours,
                "offpeak_gpu_hours": self.offpeak_gpu_hours,
                "cost": self.cost,
                "uncertainty": self.uncertainty,
                "spent_before": self.inputs.spent,
                "run_total": self.inputs.spent + self.cost,
            },
        }


def _fmt_zone(timezone: str):
    tz = ZoneInfo(timezone)
    return lambda t: t.astimezone(tz).strftime("%Y-%m-%d %H:%M %Z")


def checkpoint_seconds(params: int, gb_per_s: float) -> float:
    """Time to write (or read) one training checkpoint of a `params`-parameter model at `gb_per_s`."""
    return params * CHECKPOINT_BYTES_PER_PARAM / (gb_per_s * 1e9)


def plan_nights(schedule: ScheduleSpec, now: datetime, inp: NightInputs) -> NightPlan:
    """The nights a run of `inp.steps` steps uses from `now` under schedule.policy, priced segment by segment.

    split: each night starts at a window start (or now, inside one), provisions, restores (every night after the
    run's first), trains as many whole steps as fit before window end − checkpoint time, and checkpoints; the run
    ends in the night its last step fits. A window too short for provisioning + restore + checkpoint + one step
    is skipped; a schedule where every window is, is refused (ScheduleError: never fits). run-now and wait rent
    once, from the start decide() gives. Uncertainty per night: a night cut by its window bills until the window
    end, ± one step + half the checkpoint + STOP_S; the last night ± the step-time error over the whole run's
    training and the provisioning error."""
    now = _aware(now)
    if inp.steps < 0 or inp.gpus <= 0:
        raise ScheduleError(f"steps ({inp.steps}) must be >= 0 and gpus ({inp.gpus}) > 0")
    if inp.step_time_s is not None and not (inp.step_time_s > 0 and math.isfinite(inp.step_time_s)):
        raise ScheduleError(f"step_time_s must be finite and > 0, got {inp.step_time_s}")
    if min(inp.provisioning_s, inp.checkpoint_s, inp.restore_s) < 0:
        raise ScheduleError("provisioning, checkpoint and restore times must be >= 0")
    if schedule.policy == "split" and schedule.windows:
        try:
            next_window(schedule, now)
        except ScheduleError:  # windows cover the whole day: never cut, one stretch
            pass
        else:
            return _plan_split(schedule, now, inp)
    return _plan_once(schedule, now, inp)


def _night_segments(schedule, inp: NightInputs, start: datetime, parts: list[tuple[str, float]]) -> list[CostSegment]:
    segs: list[CostSegment] = []
    t = start
    for what, secs in parts:
        if secs > 0:
            end = t + timedelta(seconds=secs)
            segs += _segments(schedule, t, end, inp.gpus, what)
            t = end
    return segs


def _slack_cost(schedule: ScheduleSpec, gpus: int, seconds: float) -> float:
    """Uncertain seconds priced at the peak rate (they may fall outside a window)."""
    return _rates(schedule, gpus)[0] * max(0.0, seconds)


def _plan_once(schedule: ScheduleSpec, now: datetime, inp: NightInputs) -> NightPlan:
    known = inp.step_time_s is not None
    train_s = inp.step_time_s * inp.steps if known else 0.0
    restore = inp.restore_s if inp.resumed else 0.0
    decision = decide(now, schedule, inp.provisioning_s + restore + train_s)
    parts = [("provisioning", inp.provisioning_s), ("restore", restore), ("training", train_s)]
    segs = _night_segments(schedule, inp, decision.start_at, parts)
    end = segs[-1].end if segs else decision.start_at
    slack = inp.step_rel_err * train_s + inp.provisioning_rel_err * inp.provisioning_s + STOP_S
    night = Night(
        index=inp.nights_used + 1,
        start=decision.start_at,
        end=end,
        window=decision.window,
        steps=inp.steps if known else None,
        ends_run=True if known else None,
        segments=segs,
        uncertainty=_slack_cost(schedule, inp.gpus, slack),
    )
    note = "" if known else "no step-time prediction: only provisioning is priced; duration, finish and cost unknown"
    return NightPlan(schedule.policy, schedule.timezone, schedule.currency, inp, [night], known, decision.reason, note)


def _plan_split(schedule: ScheduleSpec, now: datetime, inp: NightInputs) -> NightPlan:
    fmt = _fmt(schedule)
    known = inp.step_time_s is not None
    one_step = inp.step_time_s or 0.0
    win = current_window(schedule, now)
    t = now if win is not None else None
    if win is None:
        win = next_window(schedule, now)
        t = win.start
    remaining = inp.steps
    restore_next = inp.resumed
    nights: list[Night] = []
    skipped: list[Interval] = []
    in_a_row, longest = 0, 0.0
    reason = ""
    while True:
        restore = inp.restore_s if restore_next else 0.0
        train_from = t + timedelta(seconds=inp.provisioning_s + restore)
        avail = (win.end - train_from).total_seconds() - inp.checkpoint_s
        longest = max(longest, win.seconds)
        if avail < max(one_step, 1e-9):  # not even one step fits: skip this window
            skipped.append(win)
            in_a_row += 1
            if in_a_row > 2 * len(schedule.windows) + 2:
                need = inp.provisioning_s + restore + inp.checkpoint_s + one_step
                raise ScheduleError(
                    f"a split run never fits: provisioning ({inp.provisioning_s / 60:.1f} min) + restore "
                    f"({restore:.0f} s) + checkpoint ({inp.checkpoint_s:.0f} s) + one step ({one_step:.1f} s) = "
                    f"{_h(timedelta(seconds=need))}, longer than any window ({_h(timedelta(seconds=longest))})"
                )
            win = next_window(schedule, win.end)
            t = win.start
            continue
        in_a_row = 0
        if not nights:
            reason = _split_reason(fmt, now, t, win, skipped)
        fit = math.floor(avail / one_step) if known else None
        if known and fit >= remaining:
            train_s = remaining * one_step
            parts = [("provisioning", inp.provisioning_s), ("restore", restore), ("training", train_s)]
            # a step-time error moves the end of the whole run's training: it lands on the last night
            total_train = train_s + sum(n.seconds("training") for n in nights)
            steps, ends, slack = remaining, True, inp.step_rel_err * total_train
            slack += inp.provisioning_rel_err * inp.provisioning_s + STOP_S
            remaining = 0
        else:
            train_s = fit * one_step if known else avail
            parts = [
                ("provisioning", inp.provisioning_s),
                ("restore", restore),
                ("training", train_s),
                ("checkpoint", inp.checkpoint_s),
            ]
            steps, ends, slack = fit, (False if known else None), one_step + 0.5 * inp.checkpoint_s + STOP_S
            remaining -= fit or 0
        segs = _night_segments(schedule, inp, t, parts)
        unc = _slack_cost(schedule, inp.gpus, slack)
        if not known:  # it may finish any time before the window end: the night's cost is only a bound
            unc = max(unc, sum(s.cost for s in segs if s.what == "training"))
        nights.append(Night(inp.nights_used + len(nights) + 1, t, segs[-1].end, win, steps, ends, segs, unc))
        if not known or remaining == 0:
            break
        if len(nights) >= MAX_PLANNED_NIGHTS:
            raise ScheduleError(f"the run needs more than {MAX_PLANNED_NIGHTS} nights ({remaining} steps left)")
        restore_next = True
        win = next_window(schedule, win.end)
        t = win.start
    note = ""
    if not known:
        note = (
            "no step-time prediction: the first night is priced until its window end (the run may finish "
            "earlier); nights, finish and total unknown"
        )
    return NightPlan(schedule.policy, schedule.timezone, schedule.currency, inp, nights, known, reason, note)


def _split_reason(fmt, now: datetime, start: datetime, win: Interval, skipped: list[Interval]) -> str:
    if start == now:
        return f"policy split: inside the window until {fmt(win.end)}; checkpoint there, resume in the next window"
    if skipped and skipped[0].start <= now < skipped[0].end:
        return (
            f"policy split: what is left of this window (until {fmt(skipped[0].end)}) is shorter than provisioning "
            f"+ checkpoint + one step; next usable window starts {fmt(start)}"
        )
    return f"policy split: outside the window; next starts {fmt(start)}"


def inputs_for_spec(
    spec: RunSpec,
    *,
    planner_step_s: float | None,
    planner_detail: str = "",
    runs: Sequence[RunRecord] = (),
    run_id: str | None = None,
    hours: float | None = None,
    provisioning_s: float | None = None,
) -> NightInputs:
    """The figures a plan of nights needs, each from the best source there is.

    Step time: `hours` (given) > the ledger's measured rate of the newest run of the same spec, cluster and size >
    the planner's prediction > none. Time to ready: `provisioning_s` (given) > the ledger's newest measurement on
    the same cluster > schedule.provisioning_minutes > 10 min. Checkpoint: model size × 12 B/param at
    schedule.checkpoint_gb_per_s. A run `run_id` already in `runs` is a continuation: its nights, steps and money
    carry over."""
    s, t = spec.schedule, spec.train
    mine = next((r for r in runs if run_id is not None and r.run_id == run_id), None)
    steps_done = mine.nights[-1].steps_done if mine is not None and mine.nights else 0
    spent = (sum(n.cost for n in mine.nights) if mine.nights else (mine.cost or 0.0)) if mine is not None else 0.0
    steps = max(0, t.steps - steps_done)
    if hours is not None:
        if hours <= 0:
            raise ScheduleError(f"--hours must be > 0, got {hours}")
        step, step_src = hours * 3600.0 / t.steps, f"given: {hours:g} h for {t.steps} steps"
    else:
        spec_hash = spec.spec_hash()
        measured = next(
            (
                r
                for r in runs
                if r.spec_hash == spec_hash
                and r.cluster == spec.cluster.name
                and r.world_size == spec.world_size
                and r.status in ("succeeded", "stopped")
                and r.tokens_per_s
            ),
            None,
        )
        if measured is not None:
            step = t.global_batch * t.seq_len / measured.tokens_per_s
            step_src = f"ledger: {step:.3f} s/step measured by run {measured.run_id}"
        elif planner_step_s:
            step, step_src = planner_step_s, f"planner: {planner_detail} at {planner_step_s:.3f} s/step".strip()
        else:
            step, step_src = None, "none: the planner predicts no step time here and the ledger has no measurement"
    if provisioning_s is not None:
        prov, prov_src = provisioning_s, "given"
    else:
        ready = next(
            (
                r
                for r in runs
                if r.cluster == spec.cluster.name and r.provider == spec.cluster.provider.kind and r.time_to_ready_s
            ),
            None,
        )
        if ready is not None:
            prov, prov_src = ready.time_to_ready_s, f"ledger: measured by run {ready.run_id}"
        elif s.provisioning_minutes is not None:
            prov, prov_src = s.provisioning_minutes * 60.0, "spec: schedule.provisioning_minutes"
        else:
            prov, prov_src = DEFAULT_PROVISIONING_S, "default: 10 min"
    params = count_params(resolve_model(spec.model.config or spec.model.name))
    ckpt = checkpoint_seconds(params, s.checkpoint_gb_per_s)
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    return NightInputs(
        steps=steps,
        gpus=spec.world_size,
        step_time_s=step,
        step_source=step_src,
        provisioning_s=prov,
        provisioning_source=prov_src,
        checkpoint_s=ckpt,
        restore_s=ckpt,
        checkpoint_source=f"{size} params × {CHECKPOINT_BYTES_PER_PARAM:g} B at {s.checkpoint_gb_per_s:g} GB/s",
        resumed=mine is not None,
        steps_done=steps_done,
        nights_used=len(mine.nights) if mine is not None else 0,
        spent=spent,
    )


@dataclass(frozen=True)
class BudgetCheck:
    """The budget against a plan: ok True/False, or None when it cannot be checked (no prediction, no budget)."""

    ok: bool | None
    message: str


def budget_check(schedule: ScheduleSpec, plan: NightPlan) -> BudgetCheck:
    """The plan's whole-run cost (money already spent included) against schedule.budget. Without a step-time
    prediction the budget is not claimed to hold: the run is stopped at the budget deadline instead."""
    cur = schedule.currency
    if schedule.budget is None:
        return BudgetCheck(None, "no budget set")
    spent = plan.inputs.spent
    before = f" ({spent:,.2f} {cur} already spent)" if spent else ""
    if not plan.complete:
        return BudgetCheck(
            None,
            f"budget {schedule.budget:,.2f} {cur} not checked: no step-time prediction{before}; the run stops with a "
            f"checkpoint when it has spent the budget",
        )
    total = spent + plan.cost
    if total > schedule.budget:
        return BudgetCheck(
            False,
            f"predicted cost {total:,.2f} {cur} ({plan.gpu_hours:,.2f} GPU-hours, {plan.offpeak_gpu_hours:,.2f} "
            f"off-peak, {plan.total_nights} night(s){before}) exceeds schedule.budget {schedule.budget:,.2f} {cur}",
        )
    return BudgetCheck(True, f"predicted cost {total:,.2f} {cur}{before} within budget {schedule.budget:,.2f} {cur}")


def refuse_if_over(schedule: ScheduleSpec, plan: NightPlan) -> BudgetCheck:
    """Raise BudgetExceeded or TooManyNights for a plan the spec does not allow; else the budget check."""
    check = budget_check(schedule, plan)
    if check.ok is False:
        raise BudgetExceeded(check.message)
    n = plan.total_nights
    if schedule.max_nights is not None and n is not None and n > schedule.max_nights:
        used = f", {plan.inputs.nights_used} already used" if plan.inputs.nights_used else ""
        raise TooManyNights(
            f"the run needs {n} nights{used} (finishing {plan.local(plan.finish)}); schedule.max_nights is "
            f"{schedule.max_nights}"
        )
    return check


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
