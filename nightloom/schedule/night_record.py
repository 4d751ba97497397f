"""One night as it happened: what it cost (its billing spans, priced on the gate's clock) next to what the plan of
nights predicted for it, and the run so far after it. Pure: tasks/nights.py writes the ledger and the artifact."""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel

from nightloom.ledger import NightRecord
from nightloom.schedule.cost import BillingSpan, run_cost
from nightloom.schedule.gate import GateDecision
from nightloom.spec import RunSpec
from nightloom.train.job import TrainResult


class NightsSoFar(BaseModel):
    """The run after this night: its cost over every night, nights used and left, and the predicted finish."""

    night_cost: float
    run_cost: float
    nights_used: int
    nights_left: int | None  # None: unknown (no prediction)
    predicted_finish: str | None


def night_record(
    spec: RunSpec,
    decision: GateDecision,
    started: datetime,
    provisioning_s: float,
    gpus: int,
    spans: list[BillingSpan],
    result: TrainResult,
) -> NightRecord:
    """This night, priced from its billing spans moved onto the gate's clock (the clock its windows are read on)."""
    shift = decision.clock_offset_s
    moved = [s.shifted(shift) for s in spans]
    start = started + timedelta(seconds=shift)
    cost = run_cost(spec.schedule, start, provisioning_s, gpus, moved)
    end = max(
        [s.start + timedelta(seconds=s.seconds) for s in moved], default=start + timedelta(seconds=provisioning_s)
    )
    stopped = result.stopped if result.stopped != "deadline" else (decision.deadline_kind or "deadline")
    return NightRecord(
        night=decision.night,
        start=start,
        end=end,
        steps=max(0, result.steps_done - decision.steps_done),
        steps_done=result.steps_done,
        cost=cost,
        stopped=stopped,
        predicted_steps=decision.predicted_steps,
        predicted_cost=decision.predicted_night_cost,
        uncertainty=decision.night_uncertainty,
        predicted_nights=decision.predicted_nights,
        predicted_finish=datetime.fromisoformat(decision.predicted_finish) if decision.predicted_finish else None,
    )


def nights_so_far(decision: GateDecision, night: NightRecord, run_total: float, nights_used: int) -> NightsSoFar:
    """The run after `night` (its ledger row now costs `run_total` over `nights_used` nights): none left when it
    completed, else the gate's predicted nights less this one (unknown without a prediction)."""
    done = night.stopped == "completed"
    left = (
        0 if done else (None if decision.predicted_nights is None else max(0, decision.predicted_nights - night.night))
    )
    return NightsSoFar(
        night_cost=night.cost,
        run_cost=run_total,
        nights_used=nights_used,
        nights_left=left,
        predicted_finish=None if done else decision.predicted_finish,
    )
