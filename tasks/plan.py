"""Plan task: choose the layout for the cluster we actually got, and publish the plan table."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from nightloom.ledger import calibration_for_spec
from nightloom.parallel import ParallelPlan
from nightloom.planner import plan_for_spec
from nightloom.report import wrapped_rows
from nightloom.spec import RunSpec


@task(name="plan", cache_policy=NO_CACHE)
def plan_task(spec: RunSpec, world_size: int, calibration: float | None = None, publish: bool = True) -> ParallelPlan:
    """Plan for `world_size` GPUs; the explanation goes to the log and the table to an artifact. Without an
    explicit `calibration`, the ledger's (measured/predicted MFU of verified runs like this one) is used."""
    log = get_run_logger()
    if calibration is None and (cal := calibration_for_spec(spec)) is not None:
        calibration = cal.factor
        log.info("calibration from %d ledger run(s): measured/predicted MFU %.3f", cal.runs, cal.raw_median)
    report = plan_for_spec(spec, world_size=world_size, calibration=calibration)
    plan = report.chosen
    if not publish:  # the gate's pre-plan on the requested size: one line; the plan proper follows, explained
        log.info("layout for the gate's estimate on %d requested rank(s): %s", world_size, plan.layout())
        return plan
    log.info(
        "plan: %s, micro-batch %d × accum %d, recompute %s",
        plan.layout(),
        plan.micro_batch,
        plan.grad_accum,
        plan.recompute,
    )
    for line in plan.explanation:
        log.info("  %s", line)
    if publish:
        create_table_artifact(
            key="plan",
            table=wrapped_rows(report.table_rows(rejected=20), column="reason"),  # long reasons: more rows
            description=f"Parallel plan for {spec.name}",
        )
    return plan
