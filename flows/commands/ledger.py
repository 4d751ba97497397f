"""`nightloom ledger list|best|export|copy`: read the run ledger (layouts, MFU, times, cost, nights, verdicts), or
copy it (runs and night queues) into another database (`copy --to postgresql+psycopg://...`: a team's shared one).

The ledger URL comes from --url, else the spec given with --spec (ledger.url), else $NIGHTLOOM_LEDGER_URL,
else the spec default (sqlite:///.nightloom/ledger.db). Exit codes: 0 ok, 1 nothing found (`best`) or the --spec
does not validate, 2 usage (a bad URL, a missing file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from flows.commands.common import failed, load_spec_file, spec_invalid, usage
from nightloom.ledger import RUN_STATUSES, Ledger, LedgerError, RunRecord
from nightloom.spec import LedgerSpec, SpecError

LIST_COLUMNS = (
    "run_id",
    "name",
    "model",
    "family",
    "cluster",
    "gpu_type",
    "world_size",
    "layout",
    "status",
    "predicted_mfu",
    "measured_mfu",
    "tokens_per_s",
    "duration_s",
    "cost",
    "currency",
    "started_at",
)


def register(sub) -> None:
    p = sub.add_parser(
        "ledger", help="list runs, show the best verified layout, export CSV", description=__doc__.splitlines()[0]
    )
    p.add_argument("--url", help="SQLAlchemy URL of the ledger")
    p.add_argument("--spec", help="take the ledger URL from this run spec")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    act = p.add_subparsers(dest="ledger_action", metavar="ACTION", required=True)
    ls = act.add_parser("list", help="runs, newest first")
    ls.add_argument("--model")
    ls.add_argument("--cluster")
    ls.add_argument("--status", choices=RUN_STATUSES)
    ls.add_argument("--limit", type=int, default=50)
    best = act.add_parser("best", help="the fastest verified layout for a model on a cluster")
    best.add_argument("--model", required=True)
    best.add_argument("--cluster", required=True)
    ex = act.add_parser("export", help="all runs as CSV (stdout, or --out FILE written atomically)")
    ex.add_argument("--out")
    cp = act.add_parser(
        "copy",
        help="copy every run and night queue into another ledger (nightloom.ledger.copy)",
        description="Copy the ledger (every table, every row) into --to: a second copy copies nothing new; a "
        "target holding rows of its own is refused unless --merge. Give --to without its password and set "
        "PGPASSWORD (or ~/.pgpass): a command line is visible to every user of the machine.",
    )
    cp.add_argument("--to", required=True, metavar="URL", help="the target ledger, e.g. postgresql+psycopg://u@host/db")
    cp.add_argument("--merge", action="store_true", help="copy into a target that holds runs or jobs of its own")
    for sp in (ls, best, ex, cp):  # accept the shared options after the action too (SUPPRESS: keep earlier values)
        sp.add_argument("--url", default=argparse.SUPPRESS)
        sp.add_argument("--spec", default=argparse.SUPPRESS)
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    p.set_defaults(func=run)


def ledger_url(args) -> str:
    if getattr(args, "url", None):
        return args.url
    if getattr(args, "spec", None):
        return load_spec_file(args.spec).ledger.url
    return os.environ.get("NIGHTLOOM_LEDGER_URL") or LedgerSpec().url


def _row(r: RunRecord) -> dict:
    d = r.model_dump(mode="json")
    return {k: d[k] for k in LIST_COLUMNS} | {"nights": len(r.nights)}


def _nights(r: RunRecord) -> str:
    """Nights used, and the last one's actual vs predicted cost: '2 (last 11.90 vs 12.30 ± 0.40)'."""
    if not r.nights:
        return "—"
    last = r.nights[-1]
    if last.predicted_cost is None or not (last.cost or last.predicted_cost):  # unpriced nights: the count says all
        return str(len(r.nights))
    return f"{len(r.nights)} (last {last.cost:,.2f} vs {last.predicted_cost:,.2f} ± {last.uncertainty or 0:,.2f})"


def _model(r: RunRecord) -> str:
    """The model the run trained, with its family where the name does not start with it: 'demo-llama (llama)'."""
    return r.model if r.model.lower().startswith(r.family.lower()) else f"{r.model} ({r.family})"


def _print_table(rows: list[RunRecord], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in (
        "run",
        "model",
        "cluster",
        "gpus",
        "layout",
        "status",
        "MFU pred/meas",
        "tokens/s",
        "duration",
        "cost",
        "nights",
        "started",
    ):
        # a run id is what `ledger best`, `eval` and `export` take: never cut, and whole on one line where it fits
        widest = max((len(r.run_id) for r in rows), default=0) if c == "run" else None
        t.add_column(c, overflow="fold", min_width=widest)

    def pct(x):
        return "—" if x is None else f"{x:.1%}"

    for r in rows:
        t.add_row(
            r.run_id,
            _model(r),
            r.cluster,
            f"{r.world_size}×{r.gpu_type}",
            r.layout or "—",
            r.status + (" ✓" if r.verified else ""),
            f"{pct(r.predicted_mfu)} / {pct(r.measured_mfu)}",
            "—" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
            "—" if r.duration_s is None else f"{r.duration_s / 60:.1f} min",
            "—" if r.cost is None else f"{r.cost:,.2f} {r.currency}",
            _nights(r),
            r.started_at.strftime("%Y-%m-%d %H:%M"),
        )
    Console(width=None if sys.stdout.isatty() else _pipe_width()).print(t)


def _pipe_width() -> int:
    """The table's width when piped (a file, a pager, grep): 200, or $COLUMNS where wider, so run ids and models stay
    on one line; a narrow $COLUMNS inherited from a terminal is not the pipe's width."""
    try:
        return max(200, int(os.environ.get("COLUMNS", "")))
    except ValueError:
        return 200


def copy(args) -> int:
    """`ledger copy --to URL`: each table's rows copied and already there, the total (URLs without passwords)."""
    from nightloom.ledger.copy import CopyRefused, copy_ledger

    try:
        report = copy_ledger(ledger_url(args), args.to, merge=args.merge)
    except SpecError as e:
        return spec_invalid(e)
    except CopyRefused as e:
        return failed("ledger copy", str(e))
    except (LedgerError, ValueError) as e:
        return usage("ledger copy", str(e))
    if args.json:
        print(json.dumps([dataclasses.asdict(t) for t in report.tables], indent=2))
    else:
        print("\n".join(report.lines()))
    return 0


def run(args) -> int:
    if args.ledger_action == "copy":
        return copy(args)
    try:
        url = ledger_url(args)
        lg = Ledger(url)
    except SpecError as e:
        return spec_invalid(e)
    except (LedgerError, ValueError) as e:
        return usage("ledger", str(e))
    try:
        if args.ledger_action == "list":
            runs = lg.list_runs(model=args.model, cluster=args.cluster, status=args.status, limit=args.limit)
            if args.json:
                print(json.dumps([_row(r) | {"verified": r.verified} for r in runs], indent=2))
            else:
                _print_table(runs, f"ledger {url}: {len(runs)} runs")
            return 0
        if args.ledger_action == "best":
            best = lg.best(args.model, args.cluster)
            if best is None:
                print(f"nightloom ledger: no verified run of {args.model} on cluster {args.cluster}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(best.model_dump(mode="json"), indent=2))
            else:
                _print_table([best], f"best verified layout of {args.model} on {args.cluster}")
                if best.plan:
                    print(f"plan: {best.plan.model_dump_json(exclude={'explanation', 'rejected', 'memory'})}")
            return 0
        text = lg.export_csv(args.out)
        if args.out:
            print(f"wrote {text.count(chr(10)) - 1} runs to {args.out}", file=sys.stderr)
        else:
            sys.stdout.write(text)
        return 0
    finally:
        lg.close()
