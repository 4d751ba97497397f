"""The plan of nights: when a run rents, what each night does (provision, restore, train, checkpoint), and what
each costs at the rate of the time it falls in, with a stated uncertainty.

The gate (schedule.gate), the budget (schedule.budget) and `nightloom cost` all read the same plan. Its figures
come from schedule.inputs (planner, ledger, spec); the current time is always an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from nightloom.schedule.cost import CostSegment, priced_segments, rates_per_s
from nightloom.schedule.errors import ScheduleError
from nightloom.schedule.windows import (
    Interval,
    aware_utc,
    current_window,
    decide,
    hours_text,
    local_time_format,
    next_window,
)
from nightloom.spec import ScheduleSpec

STOP_S = 30.0  # after the last checkpoint, up to this long for the processes to exit and the nodes to be released
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
        return "unknown" if t is None else local_time_format(self.timezone)(t)

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


def plan_nights(schedule: ScheduleSpec, now: datetime, inp: NightInputs) -> NightPlan:
    """The nights a run of `inp.steps` steps uses from `now` under schedule.policy, priced segment by segment.

    split: each night starts at a window start (or now, inside one), provisions, restores (every night after the
    run's first), trains as many whole steps as fit before window end − checkpoint time, and checkpoints; the run
    ends in the night its last step fits. A window too short for provisioning + restore + checkpoint + one step
    is skipped; a schedule where every window is, is refused (ScheduleError: never fits). run-now and wait rent
    once, from the start decide() gives. Uncertainty per night: a night cut by its window bills until the window
    end, ± one step + half the checkpoint + STOP_S; the last night ± the step-time error over the whole run's
    training and the provisioning error."""
    now = aware_utc(now)
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
            segs += priced_segments(schedule, t, end, inp.gpus, what)
            t = end
    return segs


def _slack_cost(schedule: ScheduleSpec, gpus: int, seconds: float) -> float:
    """Uncertain seconds priced at the peak rate (they may fall outside a window)."""
    return rates_per_s(schedule, gpus)[0] * max(0.0, seconds)


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
    fmt = local_time_format(schedule.timezone)
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
                    f"{hours_text(timedelta(seconds=need))}, longer than any window ({hours_text(timedelta(seconds=longest))})"
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
