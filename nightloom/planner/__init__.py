"""Parallelism planner. PLACEHOLDER (simple rules) until the planner issue lands: keep the signature."""

from __future__ import annotations

from nightloom.parallel import ParallelPlan


def plan_for_spec(spec, world_size: int | None = None, calibration: float | None = None):
    """Return a PlanReport-like object with `.chosen`: explicit degrees from the spec, else pure FSDP."""
    from types import SimpleNamespace

    from nightloom.spec import ParallelSpec

    ws = world_size or spec.world_size
    if isinstance(spec.parallel, ParallelSpec):
        p = spec.parallel
        rest = ws // (p.tp * p.pp * p.dp_replicate * p.cp)
        plan = ParallelPlan(tp=p.tp, pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard if p.dp_shard > 0 else rest,
                            cp=p.cp, sp=p.sp, micro_batch=p.micro_batch, virtual_stages=p.virtual_stages,
                            schedule=p.schedule, recompute=p.recompute)
    else:
        plan = ParallelPlan(dp_shard=ws, micro_batch=max(1, spec.train.global_batch // ws))
    dp = plan.dp_replicate * plan.dp_shard
    plan.grad_accum = max(1, spec.train.global_batch // (plan.micro_batch * dp))
    return SimpleNamespace(chosen=plan, alternatives=[], rejected=[], considered=1, pruned=0)
