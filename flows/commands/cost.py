"""`nightloom cost SPEC`: when the run would start, what it would cost (off-peak discount, provisioning
counted, budget), and renting vs a self-built cluster of the same size.

The run's duration is the planner's predicted step time × train.steps, or --hours (required on CPU, where
the planner predicts no step time). Exit codes: 0 ok, 1 the predicted cost exceeds schedule.budget, 2 usage.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from datetime import UTC, datetime

from nightloom.schedule import BudgetExceeded, check_budget, decide, estimate_cost, rent_vs_buy
from nightloom.spec import SpecError, load_spec


def register(sub) -> None:
    p = sub.add_parser(
        "cost",
        help="predicted cost of a spec's run (windows, budget) and rent vs buy",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("spec", help="run spec YAML")
    p.add_argument("--hours", type=float, help="run duration in hours (default: planner prediction)")
    p.add_argument(
        "--provisioning-min", type=float, default=10.0, help="minutes from renting to ready, billed too (default 10)"
    )
    p.add_argument("--at", help="decide as if now were this ISO time (default: the current time)")
    p.add_argument("--runs-per-month", type=float, default=30.0, help="for rent vs buy (default 30: nightly)")
    p.add_argument("--purchase-price", type=float, help="price of a self-built cluster of the same GPUs")
    p.add_argument("--amortisation-months", type=int, default=36)
    p.add_argument("--operations-per-month", type=float, default=28_000.0, help="power, space, staff (default 28,000)")
    p.add_argument("--idle", type=float, default=0.37, help="idle fraction of an owned cluster (default 0.37)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _duration_s(spec, hours: float | None) -> tuple[float, str]:
    if hours is not None:
        if hours <= 0:
            raise ValueError(f"--hours must be > 0, got {hours}")
        return hours * 3600.0, "--hours"
    from nightloom.planner import plan_for_spec

    chosen = plan_for_spec(spec, require_fit=False).chosen
    if chosen.step_time_s is None:
        raise ValueError(f"the planner predicts no step time for gpu_type {spec.cluster.gpu_type!r}: give --hours")
    return chosen.step_time_s * spec.train.steps, f"planner: {chosen.layout()} at {chosen.step_time_s:.3f} s/step"


def _now(at: str | None) -> datetime:
    if at is None:
        return datetime.now(UTC)
    t = datetime.fromisoformat(at)
    if t.tzinfo is None:
        raise ValueError(f"--at needs a time zone offset, e.g. 2026-06-01T01:30:00+08:00, got {at!r}")
    return t


def run(args) -> int:
    try:
        spec = load_spec(args.spec)
        dur, source = _duration_s(spec, args.hours)
        now = _now(args.at)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return 2
    except (ValueError, KeyError) as e:
        print(f"nightloom cost: {e}", file=sys.stderr)
        return 2
    s = spec.schedule
    gpus = spec.world_size
    decision = decide(now, s, dur)
    est = estimate_cost(s, decision.start_at, dur, gpus, provisioning_s=args.provisioning_min * 60)
    blended = est.cost / est.gpu_hours if est.gpu_hours else s.price_per_gpu_hour
    rvb = rent_vs_buy(
        gpus=gpus,
        gpu_hours_per_month=est.gpu_hours * args.runs_per_month,
        rent_price_per_gpu_hour=blended,
        purchase_price=args.purchase_price,
        amortisation_months=args.amortisation_months,
        operations_per_month=args.operations_per_month,
        idle_fraction=args.idle,
        currency=s.currency,
    )
    over = None
    try:
        check_budget(s, est)
    except BudgetExceeded as e:
        over = str(e)
    if args.json:
        out = {
            "decision": {
                "action": decision.action,
                "start_at": decision.start_at.isoformat(),
                "deadline": decision.deadline.isoformat() if decision.deadline else None,
                "reason": decision.reason,
            },
            "duration_s": dur,
            "duration_source": source,
            "cost": {k: v for k, v in dataclasses.asdict(est).items() if k != "segments"}
            | {"segments": [{**dataclasses.asdict(g)} for g in est.segments]},
            "budget": s.budget,
            "over_budget": over,
            "rent_vs_buy": dataclasses.asdict(rvb),
        }
        print(json.dumps(out, indent=2, default=lambda o: o.isoformat()))
    else:
        cur = s.currency
        print(
            f"{spec.name}: {gpus} × {spec.cluster.gpu_type}, {dur / 3600:.2f} h ({source}) "
            f"+ {args.provisioning_min:.0f} min provisioning"
        )
        print(f"  window: {decision.action}: {decision.reason}")
        print(
            f"  cost: {est.cost:,.2f} {cur} for {est.gpu_hours:,.2f} GPU-hours "
            f"({est.offpeak_gpu_hours:,.2f} off-peak at −{s.offpeak_discount:.0%}; list "
            f"{s.price_per_gpu_hour:,.2f} {cur}/GPU-hour)"
        )
        if s.budget is not None:
            print(f"  budget: {s.budget:,.2f} {cur}: {'EXCEEDED' if over else 'ok'}")
        print(f"  rent vs buy at {args.runs_per_month:g} runs/month ({rvb.gpu_hours_per_month:,.0f} GPU-hours):")
        print(f"    rent: {rvb.rent_per_month:,.0f} {cur}/month")
        if rvb.own_per_month is not None:
            print(
                f"    own:  {rvb.own_per_month:,.0f} {cur}/month ({args.purchase_price:,.0f} over "
                f"{rvb.amortisation_months} months + {rvb.operations_per_month:,.0f} operations); "
                f"{rvb.own_per_useful_gpu_hour:,.2f} {cur} per useful GPU-hour at {rvb.idle_fraction:.0%} idle"
            )
            print(
                f"    cheaper: {rvb.cheaper}; break-even at {rvb.break_even_gpu_hours_per_month:,.0f} GPU-hours/month"
            )
        elif rvb.break_even_purchase_price > 0:
            print(
                f"    own:  owning is cheaper only if the cluster costs under "
                f"{rvb.break_even_purchase_price:,.0f} {cur} (give --purchase-price to compare)"
            )
        else:
            print(
                f"    own:  operations alone ({rvb.operations_per_month:,.0f} {cur}/month) cost more than renting "
                f"at this usage"
            )
        if rvb.over_capacity:
            print(
                f"    note: this usage needs more than the {rvb.own_useful_gpu_hours:,.0f} useful GPU-hours a month "
                f"{gpus} owned GPUs give at {rvb.idle_fraction:.0%} idle"
            )
        lo, hi = rvb.lead_time_rent
        print(
            f"    buying takes {rvb.lead_time_days[0]}–{rvb.lead_time_days[1]} days; renting meanwhile costs "
            f"{lo:,.0f}–{hi:,.0f} {cur}"
        )
    if over:
        print(f"nightloom cost: {over}", file=sys.stderr)
        return 1
    return 0
