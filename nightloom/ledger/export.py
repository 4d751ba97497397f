"""The ledger's runs as CSV (`nightloom ledger export`): one row per run, every column, JSON columns as JSON text."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable

from nightloom.ledger.engine import RUN_COLUMNS, to_row
from nightloom.ledger.records import RunRecord


def runs_csv(runs: Iterable[RunRecord]) -> str:
    """`runs` as CSV text: a header of the table's columns, JSON columns as JSON text, times as ISO 8601."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(RUN_COLUMNS), lineterminator="\n")
    w.writeheader()
    for rec in runs:
        row = to_row(rec)
        for k in ("plan", "verdicts", "interruptions", "nights"):
            row[k] = json.dumps(row[k], sort_keys=True) if row[k] is not None else ""
        for k in ("started_at", "finished_at"):
            row[k] = row[k].isoformat() if row[k] is not None else ""
        w.writerow(row)
    return buf.getvalue()
