"""`nightloom queue create|add|list|remove|plan`: a night queue of jobs kept in the ledger, and its plan.

A queue holds at most --max-nodes nodes at once (and spends at most --budget-per-night a night). `add` reads a
spec and keeps the figures its plan needs: nodes (cluster.nodes), policy (wait: one window; split: across nights),
training hours (--hours, else the ledger's measurement, else the planner, as `nightloom cost`), provisioning,
checkpoint and restore times. The queue takes its time zone, windows and currency from its first job; a job whose
own contradict them, that needs more nodes than the queue, or whose spec does not validate, is refused with the
queue unchanged. deployments/queue-demo.yaml is a spec a queue takes as it is. `plan` packs the jobs by priority
(1 first), then deadline, then the order added.
The ledger is --ledger, else $NIGHTLOOM_LEDGER_URL, else the default ledger (sqlite:///.nightloom/ledger.db).
Exit codes: 0 ok, 1 the queue refused a job, the spec does not validate, or no such queue or job; 2 usage (bad
arguments, a missing file, no step time known: give --hours).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

from flows.commands.common import failed, load_spec_file, spec_invalid, usage
from nightloom.ledger import Ledger, LedgerError
from nightloom.queue.jobs import QueuedJob, QueueRefused, job_figures, spec_refusals
from nightloom.queue.store import QueueError, QueueRecord, QueueStore
from nightloom.queue.timetable import QueuePlan, plan_queue
from nightloom.schedule.errors import ScheduleError, StepTimeUnknown
from nightloom.schedule.windows import parse_zoned
from nightloom.spec import LedgerSpec, RunSpec, SpecError
from nightloom.wording import plural


def register(sub) -> None:
    p = sub.add_parser(
        "queue", help="a night queue of jobs in the ledger: create, add, list, remove, plan", description=__doc__
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--ledger", help="SQLAlchemy URL of the ledger (default: $NIGHTLOOM_LEDGER_URL, else the default)")
    act = p.add_subparsers(dest="queue_action", metavar="ACTION", required=True)
    create = act.add_parser("create", help="a new, empty queue")
    create.add_argument("name")
    create.add_argument("--max-nodes", type=int, required=True, help="the most nodes the queue holds at once")
    create.add_argument("--budget-per-night", type=float, help="the most one night (window) may cost")
    add = act.add_parser("add", help="add a job (a run spec) to a queue")
    add.add_argument("name")
    add.add_argument("spec", help="run spec YAML")
    add.add_argument("--priority", type=int, default=1, help="1 runs first (default 1)")
    add.add_argument("--deadline", help="ISO time with a zone offset by which the job should finish")
    add.add_argument("--hours", type=float, help="training hours (default: the ledger's measurement, else the planner)")
    ls = act.add_parser("list", help="the queue's jobs in the order added")
    ls.add_argument("name")
    ls.add_argument("--json", action="store_true")
    rm = act.add_parser("remove", help="take a job out of a queue")
    rm.add_argument("name")
    rm.add_argument("job_id", type=int)
    pl = act.add_parser("plan", help="when each job runs, on which nodes, its finish and cost, night by night")
    pl.add_argument("name")
    pl.add_argument("--at", help="plan as if now were this ISO time (default: the current time)")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--gantt", metavar="FILE", help="also draw the plan as a Gantt chart (PNG)")
    for sp in (create, add, ls, rm, pl):  # --ledger after the action too (SUPPRESS keeps an earlier value)
        sp.add_argument("--ledger", default=argparse.SUPPRESS)
    p.set_defaults(func=run)


def ledger_url(args) -> str:
    return getattr(args, "ledger", None) or os.environ.get("NIGHTLOOM_LEDGER_URL") or LedgerSpec().url


def figures_for(spec: RunSpec, hours: float | None, ledger: Ledger) -> QueuedJob:
    """The job's figures: --hours, else the ledger's measured runs on its cluster, else the planner."""
    runs = [] if hours is not None else ledger.list_runs(cluster=spec.cluster.name)
    try:
        return job_figures(spec, hours=hours, runs=runs)
    except StepTimeUnknown:  # no measurement: ask the planner (only now: it is the slow source)
        from flows.commands.cost import planner_step

        step, layout = planner_step(spec)
        return job_figures(spec, hours=hours, runs=runs, planner_step_s=step, planner_detail=layout)


def queue_plan(store: QueueStore, name: str, at: datetime) -> tuple[QueueRecord, list[QueuedJob], QueuePlan | None]:
    """The queue, its jobs and their plan from `at` (None while the queue is empty or every job is done): a job
    the nightly-queue deployment already ran is planned with the steps it has left, a finished one not at all."""
    q, jobs = store.get(name), store.jobs(name)
    left = store.plan_jobs(name)
    if q.schedule is None or not left:
        return q, jobs, None
    return q, jobs, plan_queue(q.schedule, q.max_nodes, left, at, q.budget_per_night)


def run(args) -> int:
    try:
        deadline = parse_zoned(getattr(args, "deadline", None), "--deadline")
        at = parse_zoned(getattr(args, "at", None), "--at") or datetime.now(UTC)
        spec = load_spec_file(args.spec) if args.queue_action == "add" else None
        if getattr(args, "hours", None) is not None and args.hours <= 0:
            raise ValueError(f"--hours must be > 0, got {args.hours}")
        if getattr(args, "priority", 1) < 1:
            raise ValueError(f"--priority must be >= 1 (1 runs first), got {args.priority}")
        lg = Ledger(ledger_url(args))
    except SpecError as e:
        spec_invalid(e)
        return failed("queue", "refused: the spec does not validate; the queue is unchanged")
    except (LedgerError, ValueError) as e:
        return usage("queue", str(e))
    try:
        return _act(args, QueueStore(lg), spec, deadline, at)
    except (QueueRefused, QueueError) as e:
        return failed("queue", str(e))
    except ScheduleError as e:  # StepTimeUnknown included: give --hours
        return usage("queue", f"{e}; the queue is unchanged" if args.queue_action == "add" else str(e))
    finally:
        lg.close()


def _act(args, store: QueueStore, spec: RunSpec | None, deadline: datetime | None, at: datetime) -> int:
    name = args.name
    if args.queue_action == "create":
        q = store.create(name, args.max_nodes, args.budget_per_night)
        budget = "" if q.budget_per_night is None else f", at most {q.budget_per_night:,.2f} a night"
        print(f"queue {q.name}: up to {plural(q.max_nodes, 'node')} at once{budget}")
        return 0
    if args.queue_action == "add":
        assert spec is not None
        return _add(args, store, spec, deadline)
    if args.queue_action == "remove":
        job = store.remove(name, args.job_id)
        print(f"queue {name}: removed job {job.id} {job.name}")
        return 0
    if args.queue_action == "list":
        q, jobs = store.get(name), store.jobs(name)
        if args.json:
            out = {
                "queue": q.model_dump(mode="json"),
                "jobs": [j.model_dump(mode="json", exclude={"spec", "schedule"}) | {"hours": j.hours} for j in jobs],
            }
            print(json.dumps(out, indent=2))
        else:
            _print_jobs(q, jobs)
        return 0
    q, jobs, plan = queue_plan(store, name, at)
    if plan is None:
        print(json.dumps({"jobs": [], "nights": []}) if args.json else f"queue {name}: no jobs to plan")
        return 0
    if args.gantt:
        from nightloom.queue.gantt import plot_queue_gantt

        plot_queue_gantt(plan, args.gantt, title=f"queue {name}")
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        _print_plan(q, plan)
    if args.gantt:
        print(f"wrote the Gantt chart to {args.gantt}", file=sys.stderr)
    return 0


def _add(args, store: QueueStore, spec: RunSpec, deadline: datetime | None) -> int:
    """`queue add`: the refusals the spec alone decides first (policy, windows, nodes: --hours would not help),
    then the job's hours and the transactional add (which checks them again)."""
    q = store.get(args.name)
    why = spec_refusals(
        spec.cluster.nodes, spec.schedule.policy, spec.schedule, max_nodes=q.max_nodes, queue_schedule=q.schedule
    )
    if why:
        raise QueueRefused(f"queue {args.name!r} refuses {spec.name}: " + "; ".join(why))
    fig = figures_for(spec, args.hours, store.ledger)
    job = store.add(
        args.name,
        fig,
        spec=spec.model_dump(mode="json", by_alias=True),
        priority=args.priority,
        deadline=deadline,
        spec_path=str(args.spec),
    )
    print(
        f"queue {args.name}: job {job.id} {job.name}: {plural(job.nodes, 'node')}, {job.hours:.2f} h ({job.hours_source}), "
        f"policy {job.policy}, priority {job.priority}"
        + ("" if deadline is None else f", deadline {deadline.isoformat()}")
    )
    return 0


def _print_jobs(q: QueueRecord, jobs: list[QueuedJob]) -> None:
    from rich.console import Console
    from rich.table import Table

    where = (
        ""
        if q.schedule is None
        else f"; {q.schedule.timezone}, windows " + ", ".join(f"{w.start}–{w.end}" for w in q.schedule.windows)
    )
    budget = "" if q.budget_per_night is None else f", {q.budget_per_night:,.2f} a night"
    t = Table(title=f"queue {q.name}: {plural(len(jobs), 'job')}, up to {plural(q.max_nodes, 'node')}{budget}{where}")
    for c in ("id", "name", "priority", "nodes", "policy", "hours", "source", "deadline"):
        t.add_column(c, justify="right" if c in ("id", "priority", "nodes", "hours") else "left")
    tz = q.schedule.timezone if q.schedule is not None else "UTC"
    for j in jobs:
        deadline = "—" if j.deadline is None else j.deadline.astimezone(ZoneInfo(tz)).isoformat()
        src = j.hours_source.split(":", 1)[0]
        t.add_row(str(j.id), j.name, str(j.priority), str(j.nodes), j.policy, f"{j.hours:.2f}", src, deadline)
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def _print_plan(q: QueueRecord, plan: QueuePlan) -> None:
    from rich.console import Console
    from rich.table import Table

    from nightloom.schedule.windows import local_time_format

    fmt = local_time_format(plan.timezone)
    cur = plan.currency
    t = Table(title=f"queue {q.name}: plan from {fmt(plan.at)} on {plural(q.max_nodes, 'node')}")
    for c in ("id", "name", "p", "nodes", "hours", "stretches", "start", "finish", "deadline", "met", "cost"):
        t.add_column(c, justify="right" if c in ("id", "p", "nodes", "hours", "stretches", "cost") else "left")
    for j in plan.jobs:
        stretches = sum(1 for s in j.segments if s.what == "provisioning")
        met = {None: "—", True: "yes", False: "NO"}[j.meets_deadline]
        t.add_row(
            str(j.job.id),
            j.job.name,
            str(j.job.priority),
            str(j.job.nodes),
            f"{j.job.hours:.2f}",
            str(stretches),
            fmt(j.start) if j.start else "unplanned",
            fmt(j.finish) if j.finish else "—",
            fmt(j.job.deadline) if j.job.deadline else "—",
            met,
            f"{j.cost:,.2f}",
        )
    con = Console(width=None if sys.stdout.isatty() else 160)
    con.print(t)
    for j in plan.jobs:
        if j.reason:
            con.print(f"  #{j.job.id} {j.job.name}: {j.reason}", highlight=False)
    n = Table(title="nights")
    for c in ("start", "end", "cost", "budget"):
        n.add_column(c, justify="right" if c in ("cost", "budget") else "left")
    for night in plan.nights:
        budget = "—" if night.budget is None else f"{night.budget:,.2f}"
        n.add_row(fmt(night.start), fmt(night.end), f"{night.cost:,.2f}", budget)
    con.print(n)
    print(f"  total: {plan.cost:,.2f} {cur} over {plural(len(plan.nights), 'night')}")
