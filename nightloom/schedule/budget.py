"""Budgets: refuse a run whose predicted cost (or number of nights) the spec does not allow, before anything is
rented, and the instant a running job will have spent its budget (the trainer's stop-with-checkpoint deadline)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from nightloom.schedule.cost import CostEstimate, priced_segments
from nightloom.schedule.errors import BudgetExceeded, TooManyNights
from nightloom.schedule.nights import NightPlan
from nightloom.schedule.windows import aware_utc
from nightloom.spec import ScheduleSpec


def check_budget(schedule: ScheduleSpec, estimate: CostEstimate) -> None:
    """Refuse a run whose predicted cost exceeds schedule.budget (no budget = no limit)."""
    if schedule.budget is not None and estimate.cost > schedule.budget:
        raise BudgetExceeded(
            f"predicted cost {estimate.cost:,.2f} {estimate.currency} ({estimate.gpu_hours:,.2f} GPU-hours, "
            f"{estimate.offpeak_gpu_hours:,.2f} off-peak) exceeds schedule.budget {schedule.budget:,.2f} "
            f"{schedule.currency}"
        )


def budget_deadline(
    schedule: ScheduleSpec, start: datetime, gpus: int, already_spent: float = 0.0, max_days: int = 366
) -> datetime | None:
    """When a run that started billing at `start` on `gpus` GPUs will have spent schedule.budget (less
    `already_spent`): the trainer's stop-with-checkpoint deadline. None without a budget or at price 0."""
    start = aware_utc(start, "start")
    if schedule.budget is None or schedule.price_per_gpu_hour == 0:
        return None
    left = schedule.budget - already_spent
    if left <= 0:
        return start
    t = start
    while t < start + timedelta(days=max_days):
        chunk_end = t + timedelta(days=7)
        for seg in priced_segments(schedule, t, chunk_end, gpus):
            if seg.cost >= left:
                rate = seg.cost / (seg.end - seg.start).total_seconds()
                return seg.start + timedelta(seconds=left / rate)
            left -= seg.cost
        t = chunk_end
    return None


@dataclass(frozen=True)
class BudgetCheck:
    """The budget against a plan: ok True/False, or None when it cannot be checked (no prediction, no budget)."""

    ok: bool | None
    message: str


def budget_check(schedule: ScheduleSpec, plan: NightPlan) -> BudgetCheck:
    """The plan's whole-run cost (money already spent included) against schedule.budget. Without a step-time
    prediction the budget is not claimed to hold: the run is stopped at the budget deadline instead."""
    cur = schedule.currency
    if schedule.budget is None:
        return BudgetCheck(None, "no budget set")
    spent = plan.inputs.spent
    before = f" ({spent:,.2f} {cur} already spent)" if spent else ""
    if not plan.complete:
        return BudgetCheck(
            None,
            f"budget {schedule.budget:,.2f} {cur} not checked: no step-time prediction{before}; the run stops with a "
            f"checkpoint when it has spent the budget",
        )
    total = spent + plan.cost
    if total > schedule.budget:
        return BudgetCheck(
            False,
            f"predicted cost {total:,.2f} {cur} ({plan.gpu_hours:,.2f} GPU-hours, {plan.offpeak_gpu_hours:,.2f} "
            f"off-peak, {plan.total_nights} night(s){before}) exceeds schedule.budget {schedule.budget:,.2f} {cur}",
        )
    return BudgetCheck(True, f"predicted cost {total:,.2f} {cur}{before} within budget {schedule.budget:,.2f} {cur}")


def refuse_if_over(schedule: ScheduleSpec, plan: NightPlan) -> BudgetCheck:
    """Raise BudgetExceeded or TooManyNights for a plan the spec does not allow; else the budget check."""
    check = budget_check(schedule, plan)
    if check.ok is False:
        raise BudgetExceeded(check.message)
    n = plan.total_nights
    if schedule.max_nights is not None and n is not None and n > schedule.max_nights:
        used = f", {plan.inputs.nights_used} already used" if plan.inputs.nights_used else ""
        raise TooManyNights(
            f"the run needs {n} nights{used} (finishing {plan.local(plan.finish)}); schedule.max_nights is "
            f"{schedule.max_nights}"
        )
    return check
