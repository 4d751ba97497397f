"""Record one night of a run: what it cost (its billing spans, priced on the gate's clock) next to what the plan
of nights predicted for it, in the ledger row and a `nights` artifact."""

from __future__ import annotations

from datetime import datetime, timedelta

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from nightloom.ledger import Ledger, NightRecord
from nightloom.schedule import BillingSpan, run_cost
from nightloom.spec import RunSpec
from nightloom.train.job import TrainResult
from tasks.gate import GateDecision


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


@task(name="ledger-night", cache_policy=NO_CACHE)  # no retries: an append must not run twice
def record_night_task(spec: RunSpec, run_id: str, decision: GateDecision, night: NightRecord) -> NightsSoFar:
    """Append the night to the run's ledger row (its cost becomes the sum of its nights) and publish the table of
    nights, predicted vs actual."""
    with Ledger(spec.ledger.url) as ledger:
        row = ledger.record_night(run_id, night)
    done = night.stopped == "completed"
    left = (
        0 if done else (None if decision.predicted_nights is None else max(0, decision.predicted_nights - night.night))
    )
    so_far = NightsSoFar(
        night_cost=night.cost,
        run_cost=row.cost or 0.0,
        nights_used=len(row.nights),
        nights_left=left,
        predicted_finish=None if done else decision.predicted_finish,
    )
    _artifact(spec, row.nights, so_far)
    get_run_logger().info(
        "night %d: %d steps (predicted %s), %.2f %s (predicted %s); run so far %.2f over %d night(s)",
        night.night,
        night.steps,
        night.predicted_steps if night.predicted_steps is not None else "unknown",
        night.cost,
        spec.schedule.currency,
        "unknown" if night.predicted_cost is None else f"{night.predicted_cost:.2f} ± {night.uncertainty or 0:.2f}",
        so_far.run_cost,
        so_far.nights_used,
    )
    return so_far


def _artifact(spec: RunSpec, nights: list[NightRecord], so_far: NightsSoFar) -> None:
    from prefect.artifacts import create_table_artifact

    def opt(x, fmt="{:.2f}"):
        return "unknown" if x is None else fmt.format(x)

    rows = [
        {
            "night": n.night,
            "start": n.start.isoformat(timespec="seconds"),
            "steps": f"{n.steps} (predicted {opt(n.predicted_steps, '{}')})",
            "cost": f"{n.cost:.2f} (predicted {opt(n.predicted_cost)} ± {opt(n.uncertainty)})",
            "stopped": n.stopped,
        }
        for n in nights
    ]
    rows.append(
        {
            "night": "total",
            "start": "",
            "steps": f"{nights[-1].steps_done} done",
            "cost": f"{so_far.run_cost:.2f} {spec.schedule.currency}",
            "stopped": f"nights left: {opt(so_far.nights_left, '{}')}; predicted finish: "
            f"{so_far.predicted_finish or 'unknown'}",
        }
    )
    try:
        create_table_artifact(key="nights", table=rows, description="Nights of this run: predicted vs actual")
    except Exception as e:  # noqa: BLE001 - an artifact never fails the run
        get_run_logger().warning("could not write the nights artifact: %s", type(e).__name__)
