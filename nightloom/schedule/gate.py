"""The window gate's decision: refuse, run now (with the trainer's deadline) or defer to the next window start.

Pure: it reads one plan of nights (schedule.nights.plan_nights, the one `nightloom cost` prints) and two clocks
given as arguments: the gate's `now` (injectable, the one windows are read on) and the real clock, onto which the
trainer's deadlines are mapped. tasks/gate.py reads the ledger, logs and schedules the deferred run around it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from pydantic import BaseModel

from nightloom.schedule.budget import budget_check, budget_deadline, refuse_if_over
from nightloom.schedule.nights import NightPlan
from nightloom.spec import RunSpec


class GateDecision(BaseModel):
    """What the flow does now, with the reason; deadlines are real unix times for the trainer. The night fields
    are this night's prediction, recorded in the ledger next to what the night did."""

    run_now: bool
    status: str  # run | deferred
    reason: str
    next_run_at: str | None = None
    next_flow_run_id: str | None = None
    deadline_unix: float | None = None  # checkpoint and stop (window end under split, or budget)
    deadline_kind: str | None = None  # window | budget
    stop_after_steps: int | None = None
    predicted_duration_s: float | None = None  # training time left (None: no prediction)
    predicted_cost: float | None = None  # of the nights left (None: no prediction)
    clock_offset_s: float = 0.0  # the (injected) gate clock minus the real clock: prices the run on the former
    night: int = 1  # this night's number in the run
    steps_done: int = 0  # before this night
    spent: float = 0.0  # by this run's earlier nights
    predicted_steps: int | None = None  # this night
    predicted_night_cost: float | None = None
    night_uncertainty: float | None = None
    predicted_nights: int | None = None  # the whole run (None: unknown)
    predicted_finish: str | None = None  # ISO time in the schedule's zone (None: unknown)
    budget: str = ""  # the budget check in words (never "ok" without a prediction)


def decide_gate(spec: RunSpec, nights: NightPlan, now: datetime, real_now: datetime) -> GateDecision:
    """The gate: raise BudgetExceeded or TooManyNights (both RunRefused) for a plan the spec does not allow, so that
    nothing is rented; else run now or defer (gate_decision)."""
    refuse_if_over(spec.schedule, nights)
    return gate_decision(spec, nights, now, real_now)


def gate_decision(spec: RunSpec, nights: NightPlan, now: datetime, real_now: datetime) -> GateDecision:
    """Run now or defer, from the plan of nights: under split the trainer's deadline is the window end less the
    checkpoint time; the budget deadline (also less the checkpoint) counts what earlier nights spent. Deadlines are
    mapped from the gate's (possibly injected) clock `now` onto the real clock `real_now`."""
    first, inp = nights.nights[0], nights.inputs
    known = nights.complete
    zone = ZoneInfo(spec.schedule.timezone)
    fields = dict(
        predicted_duration_s=nights.training_s if known else None,
        predicted_cost=nights.cost if known else None,
        clock_offset_s=(now - real_now).total_seconds(),
        night=first.index,
        steps_done=inp.steps_done,
        spent=inp.spent,
        predicted_steps=first.steps,
        predicted_night_cost=first.cost,
        night_uncertainty=first.uncertainty,
        predicted_nights=nights.total_nights,
        predicted_finish=None if nights.finish is None else nights.finish.astimezone(zone).isoformat(),
        budget=budget_check(spec.schedule, nights).message,
    )

    def to_real(t: datetime) -> float:  # map a time on the (possibly injected) clock onto the real clock
        return real_now.timestamp() + (t - now).total_seconds()

    if first.start > now:
        return GateDecision(
            run_now=False, status="deferred", reason=nights.reason, next_run_at=first.start.isoformat(), **fields
        )
    deadline, kind = None, None
    if spec.schedule.policy == "split" and first.window is not None:  # also when predicted to fit: a safety
        deadline, kind = to_real(first.window.end - timedelta(seconds=inp.checkpoint_s)), "window"
    bd = budget_deadline(spec.schedule, now, spec.world_size, already_spent=inp.spent)
    if bd is not None:  # the stop's checkpoint is billed too: it must end by the time the budget is spent
        bd -= timedelta(seconds=inp.checkpoint_s)
        if deadline is None or to_real(bd) < deadline:
            deadline, kind = to_real(bd), "budget"
    return GateDecision(
        run_now=True, status="run", reason=nights.reason, deadline_unix=deadline, deadline_kind=kind, **fields
    )
