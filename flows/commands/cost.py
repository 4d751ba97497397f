"""`nightloom cost SPEC`: the plan of nights the run would use (start, end, steps and cost of each, priced at the
rate of the time each part falls in), its finish time and total, the budget, and renting vs a self-built cluster.

The step time is --hours / train.steps when given, else the ledger's measured rate for the same spec, cluster and
size, else the planner's prediction (none on CPU: then give --hours). Time to ready is --provisioning-min, else
the ledger's measurement on the cluster, else schedule.provisioning_minutes, else 10 min. The gate, the budget
check and the run summary use the same plan (nightloom.schedule.nights.plan_nights).
With --choose it compares GPU types (--gpus TYPE=PRICE,...) and counts up to --max-gpus instead: each option's
hours from the planner, its nights, finish and cost, and the cheapest that meets --deadline and --budget (else the
fastest, with the reason; nightloom.schedule.rent_choice).
Exit codes: 0 ok, 1 the plan exceeds schedule.budget or schedule.max_nights (--choose: no option meets the
deadline and budget) or the spec does not validate, 2 usage (bad arguments, a missing file, no step time: --hours).
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from flows.commands.common import failed, load_spec_file, spec_invalid, usage
from nightloom.schedule.budget import refuse_if_over
from nightloom.schedule.errors import RunRefused
from nightloom.schedule.inputs import inputs_for_spec, step_time_unknown
from nightloom.schedule.nights import NightPlan, plan_nights
from nightloom.schedule.rent_vs_buy import not_compared, rent_vs_buy
from nightloom.schedule.windows import parse_zoned
from nightloom.spec import RunSpec, SpecError
from nightloom.wording import duration, plural


def register(sub) -> None:
    p = sub.add_parser(
        "cost",
        help="the plan of nights of a spec's run: cost, finish time, budget; and rent vs buy",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("spec", help="run spec YAML")
    p.add_argument("--hours", type=float, help="training time in hours (default: ledger measurement or planner)")
    p.add_argument(
        "--provisioning-min",
        type=float,
        help="minutes from renting to ready, billed each night (default: ledger, spec, else 10)",
    )
    p.add_argument("--at", help="plan as if now were this ISO time (default: the current time)")
    p.add_argument("--runs-per-month", type=float, default=30.0, help="for rent vs buy (default 30: nightly)")
    p.add_argument("--purchase-price", type=float, help="price of a self-built cluster of the same GPUs")
    p.add_argument("--amortisation-months", type=int, default=36)
    p.add_argument("--operations-per-month", type=float, default=28_000.0, help="power, space, staff (default 28,000)")
    p.add_argument("--idle", type=float, default=0.37, help="idle fraction of an owned cluster (default 0.37)")
    p.add_argument("--json", action="store_true")
    choose = p.add_argument_group("what to rent (--choose)")
    choose.add_argument(
        "--choose",
        action="store_true",
        help="compare GPU types and counts (the planner's hours, the spec's nights) and choose the cheapest that "
        "meets --deadline and --budget, else the fastest",
    )
    choose.add_argument("--gpus", help="the GPU types on offer and their prices per GPU-hour: TYPE=PRICE,...")
    choose.add_argument("--max-gpus", type=int, help="the most GPUs to rent (default: the spec's world size)")
    choose.add_argument("--deadline", help="ISO time with a zone offset by which the run must finish")
    choose.add_argument("--budget", type=float, help="the most the run may cost (default: schedule.budget)")
    p.set_defaults(func=run)


def planner_step(spec: RunSpec) -> tuple[float | None, str]:
    """The planner's step time (None on CPU) and its layout for `spec`."""
    from nightloom.planner import plan_for_spec

    chosen = plan_for_spec(spec, require_fit=False).chosen
    return chosen.step_time_s, chosen.layout()


def _ledger_runs(spec: RunSpec) -> list:
    """Past runs on this cluster (measured step time, time to ready); none when the ledger does not exist yet."""
    url = spec.ledger.url
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///") :]).expanduser().is_file():
        return []
    from nightloom.ledger import Ledger, LedgerError

    try:
        with Ledger(url) as lg:
            return lg.list_runs(cluster=spec.cluster.name)
    except (LedgerError, Exception) as e:  # noqa: BLE001 - the estimate still works from the planner
        print(f"nightloom cost: ledger {url} not read ({type(e).__name__}); using the planner", file=sys.stderr)
        return []


def _now(at: str | None) -> datetime:
    return parse_zoned(at, "--at") or datetime.now(UTC)


def build_plan(spec: RunSpec, now: datetime, hours: float | None, provisioning_min: float | None) -> NightPlan:
    """The plan `nightloom cost` prints; StepTimeUnknown (a ValueError) when no source knows the step time."""
    step, layout = (None, "") if hours is not None else planner_step(spec)
    inputs = inputs_for_spec(
        spec,
        planner_step_s=step,
        planner_detail=layout,
        runs=_ledger_runs(spec),
        hours=hours,
        provisioning_s=None if provisioning_min is None else provisioning_min * 60.0,
    )
    if inputs.step_time_s is None:
        raise step_time_unknown(spec)
    return plan_nights(spec.schedule, now, inputs)


def _decision(plan: NightPlan, now: datetime) -> dict:
    first = plan.nights[0]
    cut = first.ends_run is False and first.window is not None
    deadline = first.window.end - timedelta(seconds=plan.inputs.checkpoint_s) if cut else None
    return {
        "action": "run" if first.start <= now else "wait",
        "start_at": first.start.isoformat(),
        "deadline": deadline.isoformat() if deadline else None,
        "reason": plan.reason,
    }


def run(args) -> int:
    if args.choose:
        return run_choose(args)
    try:
        spec = load_spec_file(args.spec)
        now = _now(args.at)
        if args.provisioning_min is not None and args.provisioning_min < 0:
            raise ValueError(f"--provisioning-min must be >= 0, got {args.provisioning_min}")
        plan = build_plan(spec, now, args.hours, args.provisioning_min)
    except SpecError as e:
        return spec_invalid(e)
    except (ValueError, KeyError) as e:  # ScheduleError is a ValueError: a run that never fits, no step time
        return usage("cost", str(e))
    s = spec.schedule
    gpus = spec.world_size
    refused = None
    try:
        check = refuse_if_over(s, plan)
    except RunRefused as e:
        refused, check = str(e), None
    blended = plan.cost / plan.gpu_hours if plan.gpu_hours else s.price_per_gpu_hour
    rvb = rent_vs_buy(
        gpus=gpus,
        gpu_hours_per_month=plan.gpu_hours * args.runs_per_month,
        rent_price_per_gpu_hour=blended,
        purchase_price=args.purchase_price,
        amortisation_months=args.amortisation_months,
        operations_per_month=args.operations_per_month,
        idle_fraction=args.idle,
        currency=s.currency,
    )
    if args.json:
        _print_json(plan, now, s, refused, rvb, not_compared(spec.cluster.gpu_type, blended))
    else:
        _print_text(spec, plan, now, check, refused, rvb, args)
    if refused:
        return failed("cost", refused)
    return 0


def _print_json(plan: NightPlan, now: datetime, s, refused: str | None, rvb, skipped: str | None) -> None:
    import dataclasses

    segs = [g for n in plan.nights for g in n.segments]
    out = {
        "decision": _decision(plan, now),
        "duration_s": plan.training_s,
        "duration_source": plan.inputs.step_source,
        "cost": {
            "gpus": plan.inputs.gpus,
            "start": plan.start.isoformat(),
            "end": plan.nights[-1].end.isoformat(),
            "provisioning_s": plan.inputs.provisioning_s,
            "gpu_hours": plan.gpu_hours,
            "offpeak_gpu_hours": plan.offpeak_gpu_hours,
            "cost": plan.cost,
            "uncertainty": plan.uncertainty,
            "currency": plan.currency,
            "segments": [{**dataclasses.asdict(g)} for g in segs],
        },
        "plan": plan.to_json(),
        "budget": s.budget,
        "max_nights": s.max_nights,
        "over_budget": refused,
        "rent_vs_buy": dataclasses.asdict(rvb),
        "rent_vs_buy_not_compared": skipped,
    }
    print(json.dumps(out, indent=2, default=lambda o: o.isoformat()))


def _print_text(spec: RunSpec, plan: NightPlan, now: datetime, check, refused: str | None, rvb, args) -> None:
    from rich.console import Console
    from rich.table import Table

    s, cur, inp = spec.schedule, spec.schedule.currency, plan.inputs
    print(
        f"{spec.name}: {inp.gpus} × {spec.cluster.gpu_type}, {inp.steps} steps, {duration(plan.training_s / 3600)} of "
        f"training ({inp.step_source}); provisioning {inp.provisioning_s / 60:.1f} min ({inp.provisioning_source}); "
        f"checkpoint {inp.checkpoint_s:.0f} s ({inp.checkpoint_source})"
    )
    print(f"  window: {'run' if plan.start <= now else 'wait'}: {plan.reason}")
    t = Table(title=f"nights (policy {plan.policy}, {plan.timezone})")
    for c in (
        "night",
        "start",
        "end",
        "steps",
        "provision",
        "restore",
        "train",
        "checkpoint",
        "GPU-h off/peak",
        "cost",
    ):
        t.add_column(c, justify="right" if c not in ("start", "end") else "left")
    shown = plan.nights if len(plan.nights) <= 12 else plan.nights[:6] + plan.nights[-6:]
    for i, n in enumerate(shown):
        if i == 6 and len(plan.nights) > 12:
            t.add_row("…", f"{len(plan.nights) - 12} more", "", "", "", "", "", "", "", "")

        def m(what: str, n=n) -> str:
            sec = n.seconds(what)
            return "—" if sec == 0 else f"{sec / 60:.0f} min" if sec < 5400 else f"{sec / 3600:.2f} h"

        t.add_row(
            str(n.index),
            plan.local(n.start),
            plan.local(n.end),
            "?" if n.steps is None else f"{n.steps:,}" + (" (end)" if n.ends_run else ""),
            m("provisioning"),
            m("restore"),
            m("training"),
            m("checkpoint"),
            f"{n.offpeak_gpu_hours:,.1f} / {n.gpu_hours - n.offpeak_gpu_hours:,.1f}",
            f"{n.cost:,.2f} ± {n.uncertainty:,.2f}",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    nights = "unknown" if plan.total_nights is None else str(plan.total_nights)
    print(f"  nights: {nights}; predicted finish: {plan.local(plan.finish)}")
    print(
        f"  cost: {plan.cost:,.2f} ± {plan.uncertainty:,.2f} {cur} for {plan.gpu_hours:,.2f} GPU-hours "
        f"({plan.offpeak_gpu_hours:,.2f} off-peak at −{s.offpeak_discount:.0%}; list {s.price_per_gpu_hour:,.2f} "
        f"{cur}/GPU-hour)" + (f"; {inp.spent:,.2f} {cur} already spent" if inp.spent else "")
    )
    if plan.note:
        print(f"  note: {plan.note}")
    if s.budget is not None or s.max_nights is not None:
        print(f"  limits: {'REFUSED: ' + refused if refused else check.message}")
    _print_rent_vs_buy(rvb, not_compared(spec.cluster.gpu_type, rvb.rent_price_per_gpu_hour), inp.gpus, args)


def _print_rent_vs_buy(rvb, skipped: str | None, gpus: int, args) -> None:
    """Renting vs owning the same GPUs, or why it is not compared (CPU ranks, no price)."""
    cur = rvb.currency
    if skipped:
        print(f"  rent vs buy: not compared: {skipped}")
        return
    print(f"  rent vs buy at {args.runs_per_month:g} runs/month ({rvb.gpu_hours_per_month:,.0f} GPU-hours):")
    print(f"    rent: {rvb.rent_per_month:,.0f} {cur}/month")
    if rvb.own_per_month is not None:
        print(
            f"    own:  {rvb.own_per_month:,.0f} {cur}/month ({args.purchase_price:,.0f} over "
            f"{rvb.amortisation_months} months + {rvb.operations_per_month:,.0f} operations); "
            f"{rvb.own_per_useful_gpu_hour:,.2f} {cur} per useful GPU-hour at {rvb.idle_fraction:.0%} idle"
        )
        print(f"    cheaper: {rvb.cheaper}; break-even at {rvb.break_even_gpu_hours_per_month:,.0f} GPU-hours/month")
    elif rvb.break_even_purchase_price > 0:
        print(
            f"    own:  owning is cheaper only if the cluster costs under "
            f"{rvb.break_even_purchase_price:,.0f} {cur} (give --purchase-price to compare)"
        )
    else:
        print(
            f"    own:  never cheaper at this usage: running {plural(gpus, 'owned GPU')} (power, space, staff: "
            f"{rvb.operations_per_month:,.0f} {cur}/month, --operations-per-month) costs more than renting, "
            "before the purchase price"
        )
    if rvb.over_capacity:
        print(
            f"    note: this usage needs more than the {rvb.own_useful_gpu_hours:,.0f} useful GPU-hours a month "
            f"{plural(gpus, 'owned GPU')} give at {rvb.idle_fraction:.0%} idle"
        )
    lo, hi = rvb.lead_time_rent
    print(
        f"    buying takes {rvb.lead_time_days[0]}–{rvb.lead_time_days[1]} days; renting meanwhile costs "
        f"{lo:,.0f}–{hi:,.0f} {cur}"
    )


def run_choose(args) -> int:
    """`cost SPEC --choose`: every GPU type and count, and the one to rent."""
    from nightloom.schedule.rent_choice import parse_gpu_prices, rent_options

    try:
        if not args.gpus:
            raise ValueError("--choose needs --gpus TYPE=PRICE,... (the GPU types on offer and their prices)")
        if args.hours is not None:
            raise ValueError("--choose takes each option's hours from the planner: drop --hours")
        prices = parse_gpu_prices(args.gpus)
        spec = load_spec_file(args.spec)
        now = _now(args.at)
        deadline = parse_zoned(args.deadline, "--deadline")
        if args.budget is not None and args.budget <= 0:
            raise ValueError(f"--budget must be > 0, got {args.budget}")
        result = rent_options(spec, prices, now, max_gpus=args.max_gpus, deadline=deadline, budget=args.budget)
    except SpecError as e:
        return spec_invalid(e)
    except ValueError as e:
        return usage("cost", str(e))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        _print_choice(spec, result)
    if result.choice is None or not result.choice.acceptable:
        return failed("cost", result.reason)
    return 0


def _print_choice(spec: RunSpec, result) -> None:
    from rich.console import Console
    from rich.table import Table

    from nightloom.schedule.windows import local_time_format

    fmt, cur = local_time_format(spec.schedule.timezone), spec.schedule.currency
    t = Table(title=f"{spec.name}: what to rent ({spec.train.steps} steps, policy {spec.schedule.policy})")
    cols = ("GPU", "GPUs", "nodes", "layout", "training", "nights", "finish", "cost", "of it provisioning")
    for c in (*cols, "deadline", "budget"):
        t.add_column(c, justify="right" if c in cols[1:3] + cols[4:6] + cols[7:] else "left")
    mark = {None: "—", True: "ok", False: "NO"}
    for o in result.options:
        chosen = " ◀" if o is result.choice else ""
        t.add_row(
            o.gpu_type + chosen,
            str(o.gpus),
            str(o.nodes),
            o.layout,
            duration(o.hours),
            str(o.nights),
            fmt(o.finish),
            f"{o.cost:,.2f} {cur}",
            f"{o.overhead_cost:,.2f} {cur}",
            mark[o.meets_deadline],
            mark[o.within_budget],
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    if result.options:
        print(
            f"  cost: the GPUs rented from provisioning ({result.options[0].provisioning_min:.0f} min a night) to the "
            "last step; 'provisioning' is the money paid while the nodes get ready (and restore or save checkpoints)"
        )
    for r in result.rejected:
        print(f"  rejected {r.gpus} × {r.gpu_type}: {r.reason}")
    if result.choice is not None:
        c = result.choice
        print(
            f"  choice: {c.gpus} × {c.gpu_type} ({c.layout}), {c.cost_text(cur)}, training {duration(c.hours)}, "
            f"finish {fmt(c.finish)}: {result.reason}"
        )
