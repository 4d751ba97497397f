"""Plan task: choose the layout for the cluster we actually got, and publish the plan table."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from nightloom.ledger import calibration_for_spec
from nightloom.parallel import ParallelPlan
from nightloom.planner import plan_for_spec
from nightloom.spec import RunSpec


def plan_rows(report) -> list[dict]:
    rows = []
    for tag, p in [("chosen", report.chosen)] + [("alternative", a) for a in report.alternatives[:5]]:
        rows.append(
            {
                "": tag,
                "layout": p.layout(),
                "micro_batch": p.micro_batch,
                "grad_accum": p.grad_accum,
                "recompute": p.recompute,
                "schedule": p.schedule,
                "mem_gib": None if p.memory_gib_per_gpu is None else round(p.memory_gib_per_gpu, 2),
                "fits": p.fits,
                "mfu": None if p.mfu is None else round(p.mfu, 4),
                "tokens_per_s": None if p.tokens_per_s is None else round(p.tokens_per_s),
            }
        )
    for r in report.rejected[:20]:
        rows.append({"": "rejected", "layout": r.layout, "reason": r.reason})
    return rows


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
        create_table_artifact(key="plan", table=plan_rows(report), description=f"Parallel plan for {spec.name}")
    return plan
