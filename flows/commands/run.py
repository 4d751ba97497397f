"""`nightloom run SPEC`: run the whole pipeline as a Prefect flow and print its summary."""

from __future__ import annotations

import sys

from flows import check_data
from nightloom.report import NOT_MEASURED
from nightloom.sharding.errors import BadInputError
from nightloom.spec import SpecError
from nightloom.spec.load import load_spec


def register(sub) -> None:
    p = sub.add_parser("run", help="run the whole pipeline for a spec (a Prefect flow run)")
    p.add_argument("spec", help="path to the run spec YAML")
    p.add_argument("--resume", metavar="RUN_ID", help="continue a split or interrupted run in its folder")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def print_summary(summary) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(markup=False, emoji=False)  # values printed as they are (`:100:` is no emoji)
    t = Table(title=f"nightloom run {summary.run_id}: {summary.status}", show_header=False)
    t.add_column("", style="bold")
    t.add_column("", overflow="fold")  # a long path wraps, not cut with "…"

    def fmt(x, spec="{:.4g}"):
        return NOT_MEASURED if x is None else spec.format(x)

    t.add_row(
        "shards",
        f"{summary.shards} (imbalance {fmt(summary.shard_imbalance, '{:.2%}')}, "
        f"{'balanced' if summary.shards_balanced else 'NOT balanced'})",
    )
    t.add_row("plan", f"{summary.layout or '-'} on {summary.world_size} ranks")
    t.add_row("loss", summary.loss_text())
    t.add_row("tokens/s", fmt(summary.tokens_per_s, "{:,.0f}"))
    t.add_row(
        "MFU",
        f"{fmt(summary.mfu, '{:.2%}')} (planned {fmt(summary.mfu_predicted, '{:.2%}')}; "
        f"peak {summary.peak_source or '-'})",
    )
    if summary.cost:  # a price is set (a run without one costs 0.00 by definition: not shown)
        t.add_row("cost", f"{summary.cost:.2f} {summary.currency}")
        t.add_row("nights", summary.nights_text())
    for v in summary.verdicts:
        t.add_row(f"gate {v.name}", f"{v.label}: {v.reason}")
    for name, text in summary.figure_rows():  # benchmarks: base -> tuned per task and metric
        t.add_row(name, text)
    t.add_row("stages", ", ".join(f"{s.stage} {s.seconds:.1f}s" for s in summary.stages))
    if summary.preemptions:
        t.add_row("preemptions", summary.preemptions_text())
    if summary.reason:
        t.add_row("reason", summary.reason)
    con.print(t)
    # outside the table, whole and on one line each, so they can be copied
    print(f"ledger row: {summary.ledger_id}")
    print(f"run dir:    {summary.run_dir}")
    for field, path in summary.output_rows():  # the export and the adapter, where the run wrote them
        print(f"{field + ':':<11} {path}")


def run(args) -> int:
    try:
        check_data(load_spec(args.spec))  # fail fast with every field error and bad record, before Prefect starts
    except (SpecError, BadInputError) as e:
        print(str(e), file=sys.stderr)
        return 1
    from flows.pipeline import training_pipeline
    from nightloom.train.preempt import PREEMPTED_EXIT, Forward

    try:
        with Forward.installed():  # SIGTERM / Ctrl-C: the ranks save and stop, the nodes are released
            summary = training_pipeline(args.spec, resume_run_id=args.resume)
    except Exception as e:  # the flow failed: its reason is the message
        print(f"run failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(summary.model_dump_json(indent=2))
    else:
        print_summary(summary)
    if summary.status == "preempted":
        print(f"continue with: nightloom run {args.spec} --resume {summary.run_id}", file=sys.stderr)
        return PREEMPTED_EXIT
    return 0 if summary.status in ("completed", "deferred", "split") else 1
