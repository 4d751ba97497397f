"""The off-peak window gate as a Prefect task: read the ledger for the plan of nights, ask the gate, log its
answer and schedule the deferred run. The decision itself (refuse, run now with a deadline, or defer) is
nightloom.schedule.gate.decide_gate, from the plan `nightloom cost` prints (nightloom.schedule.nights.plan_nights).
"""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.runtime import deployment as current_deployment
from prefect.runtime import flow_run as current_run

from nightloom.ledger import Ledger
from nightloom.parallel import ParallelPlan
from nightloom.schedule.gate import GateDecision, decide_gate
from nightloom.schedule.inputs import inputs_for_spec
from nightloom.schedule.nights import NightPlan, plan_nights
from nightloom.spec import RunSpec


def schedule_same_deployment(parameters: dict, at: datetime) -> str | None:
    """Create a scheduled run of this flow run's deployment at `at`; None when not running from a deployment, or
    when this is a subflow (Prefect hands a subflow its parent's deployment: the nightly queue's pipelines would
    schedule `training-pipeline/nightly-queue`, which does not exist; the queue replans them itself)."""
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None and ctx.flow_run.parent_task_run_id is not None:
        return None
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


@task(name="window-gate", cache_policy=NO_CACHE)
def gate_task(spec: RunSpec, plan: ParallelPlan, shape, run_id: str, now: datetime | None = None) -> GateDecision:
    """Decide from the clock (`now` injectable), the windows and the plan of nights; refuse (RunRefused) a run
    over budget or over schedule.max_nights before anything is rented; schedule the deferred run."""
    log = get_run_logger()
    real_now = datetime.now(UTC)
    now = now or real_now
    nights = night_plan(spec, plan, run_id, now)
    decision = decide_gate(spec, nights, now, real_now)  # raises BudgetExceeded / TooManyNights
    parts = [f"window gate: {nights.reason}"]
    if nights.total_nights is not None:  # nights and a finish are predicted only when they are known
        parts.append(f"night {decision.night} of {nights.total_nights}, finish {nights.local(nights.finish)}")
    if spec.schedule.price_per_gpu_hour > 0:  # no price set: no cost to show
        parts.append(f"cost {nights.cost:.2f} ± {nights.uncertainty:.2f} {nights.currency}")
    parts += [p for p in (decision.budget, nights.note) if p]
    log.info("; ".join(parts))
    if decision.run_now:
        return decision
    resume = run_id if nights.inputs.resumed else None
    params = {"spec": spec.model_dump(mode="json", by_alias=True), "resume_run_id": resume}
    next_id = schedule_same_deployment(params, nights.start)
    where = f"scheduled flow run {next_id}" if next_id else "start it again then (not running from a deployment)"
    return decision.model_copy(update={"reason": f"{decision.reason}; {where}", "next_flow_run_id": next_id})
