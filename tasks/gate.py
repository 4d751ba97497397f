"""The off-peak window gate and budget check: run now, defer to the next window, or split at the window end.

The decision, the budget and the night-count limit all come from one plan of nights
(nightloom.schedule.plan_nights), the one `nightloom cost` prints.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment as current_deployment
from prefect.runtime import flow_run as current_run
from pydantic import BaseModel

from nightloom.ledger import Ledger
from nightloom.parallel import ParallelPlan
from nightloom.schedule import (
    NightPlan,
    budget_check,
    budget_deadline,
    inputs_for_spec,
    plan_nights,
    refuse_if_over,
)
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


def predicted_duration_s(plan: ParallelPlan, steps: int) -> float:
    """Predicted training time from the plan (0 when the planner made no prediction, e.g. on CPU)."""
    return (plan.step_time_s or 0.0) * steps


def schedule_same_deployment(parameters: dict, at: datetime) -> str | None:
    """Create a scheduled run of this flow run's deployment at `at`; None when not running from a deployment."""
    dep = current_deployment.get_name()
    flow_name = current_run.get_flow_name()
    if not dep or not flow_name:
        return None
    from prefect.deployments import run_deployment

    fr = run_deployment(f"{flow_name}/{dep}", parameters=parameters, scheduled_time=at, timeout=0, as_subflow=False)
    return str(fr.id)


def night_plan(spec: RunSpec, plan: ParallelPlan, run_id: str, now: datetime) -> NightPlan:
    """The plan of nights for this run from `now`: planner step time, the ledger's measurements and, for a
    continuation, the nights, steps and money this run already used."""
    with Ledger(spec.ledger.url) as ledger:
        runs = ledger.list_runs(cluster=spec.cluster.name)
    inputs = inputs_for_spec(
        spec, planner_step_s=plan.step_time_s, planner_detail=plan.layout(), runs=runs, run_id=run_id
    )
    return plan_nights(spec.schedule, now, inputs)


def gate_decision(spec: RunSpec, nights: NightPlan, now: datetime, real_now: datetime) -> GateDecision:
    """Run now or defer, from the plan of nights (no I/O): under split the trainer's deadline is the window end
    less the checkpoint time; the budget deadline (also less the checkpoint) counts what earlier nights spent.
    Deadlines are mapped from the gate's (possibly injected) clock `now` onto the real clock `real_now`."""
    first, inp = nights.nights[0], nights.inputs
    known = nights.complete
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
        predicted_finish=None if nights.finish is None else nights.finish.astimezone(_zone(spec)).isoformat(),
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


@task(name="window-gate", cache_policy=NO_CACHE)
def gate_task(spec: RunSpec, plan: ParallelPlan, shape, run_id: str, now: datetime | None = None) -> GateDecision:
    """Decide from the clock (`now` injectable), the windows and the plan of nights; refuse (RunRefused) a run
    over budget or over schedule.max_nights before anything is rented; schedule the deferred run."""
    log = get_run_logger()
    real_now = datetime.now(UTC)
    now = now or real_now
    nights = night_plan(spec, plan, run_id, now)
    refuse_if_over(spec.schedule, nights)  # raises BudgetExceeded / TooManyNights
    decision = gate_decision(spec, nights, now, real_now)
    log.info(
        "window gate: %s; night %d of %s, finish %s, cost %.2f ± %.2f %s; %s%s",
        nights.reason,
        decision.night,
        "unknown" if nights.total_nights is None else nights.total_nights,
        nights.local(nights.finish),
        nights.cost,
        nights.uncertainty,
        nights.currency,
        decision.budget,
        f"; {nights.note}" if nights.note else "",
    )
    if decision.run_now:
        return decision
    resume = run_id if nights.inputs.resumed else None
    params = {"spec": spec.model_dump(mode="json", by_alias=True), "resume_run_id": resume}
    next_id = schedule_same_deployment(params, nights.start)
    where = f"scheduled flow run {next_id}" if next_id else "start it again then (not running from a deployment)"
    return decision.model_copy(update={"reason": f"{decision.reason}; {where}", "next_flow_run_id": next_id})


def _zone(spec: RunSpec):
    from zoneinfo import ZoneInfo

    return ZoneInfo(spec.schedule.timezone)
