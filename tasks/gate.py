"""The off-peak window gate and budget check: run now, defer to the next window, or split at the window end."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment as current_deployment
from prefect.runtime import flow_run as current_run
from pydantic import BaseModel

from nightloom.parallel import ParallelPlan
from nightloom.schedule import budget_deadline, check_budget, decide, estimate_cost
from nightloom.spec import RunSpec


class GateDecision(BaseModel):
    """What the flow does now, with the reason; deadlines are real unix times for the trainer."""

    run_now: bool
    status: str  # run | deferred
    reason: str
    next_run_at: str | None = None
    next_flow_run_id: str | None = None
    deadline_unix: float | None = None  # checkpoint and stop (window end under split, or budget)
    deadline_kind: str | None = None  # window | budget
    stop_after_steps: int | None = None
    predicted_duration_s: float | None = None
    predicted_cost: float | None = None


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


@task(name="window-gate", cache_policy=NO_CACHE)
def gate_task(spec: RunSpec, plan: ParallelPlan, shape, run_id: str, now: datetime | None = None) -> GateDecision:
    """Decide from the clock (`now` injectable), the windows and the plan's predicted duration and cost."""
    log = get_run_logger()
    real_now = datetime.now(UTC)
    now = now or real_now
    duration = predicted_duration_s(plan, spec.train.steps)
    decision = decide(now, spec.schedule, duration)
    start = decision.start_at
    est = estimate_cost(spec.schedule, start, duration, spec.world_size)
    check_budget(spec.schedule, est)  # raises BudgetExceeded: refuse before anything is rented
    log.info("window gate: %s (predicted %.0f s, cost %.2f %s)", decision.reason, duration, est.cost, est.currency)

    def to_real(t: datetime) -> float:  # map a time on the (possibly injected) clock onto the real clock
        return time.time() + (t - now).total_seconds()

    if decision.action == "wait":
        params = {"spec": spec.model_dump(mode="json", by_alias=True), "resume_run_id": None}
        next_id = schedule_same_deployment(params, decision.start_at)
        where = f"scheduled flow run {next_id}" if next_id else "start it again then (not running from a deployment)"
        return GateDecision(
            run_now=False,
            status="deferred",
            reason=f"{decision.reason}; {where}",
            next_run_at=decision.start_at.isoformat(),
            next_flow_run_id=next_id,
            predicted_duration_s=duration,
            predicted_cost=est.cost,
        )

    deadline, kind = None, None
    if decision.deadline is not None:
        deadline, kind = to_real(decision.deadline), "window"
    bd = budget_deadline(spec.schedule, start, spec.world_size)
    if bd is not None and (deadline is None or to_real(bd) < deadline):
        deadline, kind = to_real(bd), "budget"
    return GateDecision(
        run_now=True,
        status="run",
        reason=decision.reason,
        deadline_unix=deadline,
        deadline_kind=kind,
        predicted_duration_s=duration,
        predicted_cost=est.cost,
    )
