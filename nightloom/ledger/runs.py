"""The run ledger: one row per run (layout, predicted vs measured MFU, times, cost, verdicts), any SQLAlchemy URL.

`Ledger` opens (and migrates) it and holds its writes and queries; the records are in records.py, the table, the
Alembic bootstrap and SQLite's retries in engine.py, the planner's calibration in calibration.py, the CSV export
in export.py. Safe to use from several processes (engine.py says how).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self, TypeVar

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from nightloom.gates import Verdict
from nightloom.ledger.calibration import Calibration, calibrate
from nightloom.ledger.engine import (
    MUTABLE,
    RunRow,
    current_revisions,
    from_row,
    migrate,
    open_engine,
    retry,
    to_row,
    where,
)
from nightloom.ledger.export import runs_csv
from nightloom.ledger.model import spec_run_model
from nightloom.ledger.records import Figure, Interruption, LedgerError, NightRecord, RunRecord, RunStatus
from nightloom.parallel import ParallelPlan
from nightloom.util import atomic_write_text

T = TypeVar("T")


class Ledger:
    """Open (and create or check the schema of) the ledger at `url`. Safe to use from several processes."""

    def __init__(self, url: str, *, busy_timeout_s: float = 30.0, retries: int = 20):
        self.url = url
        self.retries = retries
        self.engine: Engine = open_engine(url, busy_timeout_s)
        self.retry(lambda: migrate(self.engine, url))

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing

    def retry(self, fn: Callable[[], T]) -> T:
        """Run one transaction `fn`, retrying on SQLite lock/busy errors with jittered backoff."""
        return retry(fn, self.retries)

    def where(self) -> str:
        """The ledger's URL as its messages name it (password hidden)."""
        return where(self.url)

    def schema_version(self) -> int:
        """The ledger's schema version: the number of its Alembic revision ('0002' → 2)."""
        with self.engine.connect() as conn:
            return int(current_revisions(conn)[0])

    def _modify(self, run_id: str, change: Callable[[RunRow], None]) -> RunRecord:
        def tx() -> RunRecord:
            with Session(self.engine, expire_on_commit=False) as s, s.begin():
                row = s.execute(select(RunRow).where(RunRow.run_id == run_id).with_for_update()).scalar_one_or_none()
                if row is None:
                    raise LedgerError(f"no run {run_id!r} in the ledger {self.where()}")
                change(row)
                s.flush()
                rec = from_row(row)
            return rec

        return self.retry(tx)

    # -- writes

    def start_run(self, **fields: Any) -> RunRecord:
        """Insert a run's row from RunRecord's fields (run_id, spec_hash, name, model, cluster, provider, gpu_type and
        world_size at least): status `running`, started now, layout and predicted MFU the plan's, unless given. A
        duplicate run id is an error."""
        plan = fields.get("plan")
        if plan is not None:
            fields.setdefault("layout", plan.layout())
            if fields.get("predicted_mfu") is None:
                fields["predicted_mfu"] = plan.mfu
        rec = RunRecord(**{**fields, "started_at": fields.get("started_at") or datetime.now(UTC)})
        run_id = rec.run_id

        def tx() -> None:
            with Session(self.engine) as s, s.begin():
                s.add(RunRow(**to_row(rec)))

        try:
            self.retry(tx)
        except IntegrityError:
            raise LedgerError(f"run {run_id!r} is already in the ledger {self.where()}") from None
        return self.get(run_id)

    def update_run(self, run_id: str, **fields: Any) -> RunRecord:
        """Set some fields of a run; names and types are checked against RunRecord."""
        bad = set(fields) - MUTABLE
        if bad:
            raise LedgerError(f"update_run({run_id!r}): cannot set {sorted(bad)}; settable: {sorted(MUTABLE)}")
        if "plan" in fields and fields["plan"] is not None and "layout" not in fields:
            fields["layout"] = ParallelPlan.model_validate(fields["plan"]).layout()

        def change(row: RunRow) -> None:
            merged = from_row(row).model_dump() | fields
            rec = RunRecord.model_validate(merged)  # type check before writing
            new = to_row(rec)
            for k in fields:
                setattr(row, k, new[k])

        return self._modify(run_id, change)

    def finish_run(
        self,
        run_id: str,
        *,
        status: RunStatus,
        measured_mfu: float | None = None,
        hfu: float | None = None,
        tokens_per_s: float | None = None,
        final_loss: float | None = None,
        duration_s: float | None = None,
        cost: float | None = None,
        verdicts: Iterable[Verdict] | None = None,
        figures: Iterable[Figure] | None = None,
        precision: str | None = None,
        peak_source: str | None = None,
        reason: str | None = None,
        finished_at: datetime | None = None,
    ) -> RunRecord:
        """Record how the run ended. Only the figures given are written (None leaves a field as it was)."""
        given = {
            "measured_mfu": measured_mfu,
            "hfu": hfu,
            "tokens_per_s": tokens_per_s,
            "final_loss": final_loss,
            "duration_s": duration_s,
            "cost": cost,
            "precision": precision,
            "peak_source": peak_source,
            "reason": reason,
            "verdicts": list(verdicts) if verdicts is not None else None,
            "figures": list(figures) if figures is not None else None,
        }
        fields = {k: v for k, v in given.items() if v is not None}
        return self.update_run(run_id, status=status, finished_at=finished_at or datetime.now(UTC), **fields)

    def record_interruption(self, run_id: str, **fields: Any) -> RunRecord:
        """Append an interruption (Interruption's fields: kind, and detail, recovery_s, lost_s, cost, `at` now unless
        given) and add its recovery time (atomic under concurrent writers)."""
        item = Interruption(**{**fields, "at": fields.get("at") or datetime.now(UTC)})
        kind, recovery_s, lost_s = item.kind, item.recovery_s, item.lost_s

        def change(row: RunRow) -> None:
            row.interruptions = [*(row.interruptions or []), item.model_dump(mode="json")]
            if kind == "preemption":  # counted apart from failures, with its time lost
                row.preemptions = (row.preemptions or 0) + 1
                row.preemption_lost_s = (row.preemption_lost_s or 0) + (lost_s or 0)
                return
            row.interruption_count = (row.interruption_count or 0) + 1
            row.recovery_s = (row.recovery_s or 0.0) + (recovery_s or 0.0)

        return self._modify(run_id, change)

    def record_night(self, run_id: str, night: NightRecord) -> RunRecord:
        """Append one night (atomic under concurrent writers) and set the run's cost to the sum of its nights."""

        def change(row: RunRow) -> None:
            nights = [*(row.nights or []), night.model_dump(mode="json")]
            row.nights = nights
            row.cost = sum(n["cost"] for n in nights)

        return self._modify(run_id, change)

    # -- reads

    def get(self, run_id: str) -> RunRecord:
        def tx() -> RunRecord:
            with Session(self.engine) as s:
                row = s.get(RunRow, run_id)
                if row is None:
                    raise LedgerError(f"no run {run_id!r} in the ledger {self.where()}")
                return from_row(row)

        return self.retry(tx)

    def list_runs(
        self,
        *,
        model: str | None = None,
        cluster: str | None = None,
        status: str | None = None,
        spec_hash: str | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        """Runs, newest first, optionally filtered (`model`: the name of the model the run trained)."""
        q = select(RunRow).order_by(RunRow.started_at.desc(), RunRow.run_id)
        for col, val in (
            (RunRow.model, model),
            (RunRow.cluster, cluster),
            (RunRow.status, status),
            (RunRow.spec_hash, spec_hash),
        ):
            if val is not None:
                q = q.where(col == val)
        if limit is not None:
            q = q.limit(limit)

        def tx() -> list[RunRecord]:
            with Session(self.engine) as s:
                return [from_row(r) for r in s.execute(q).scalars()]

        return self.retry(tx)

    def best(self, model: str, cluster: str) -> RunRecord | None:
        """The fastest verified run (highest tokens/s; ties: higher MFU, then newest) for a model on a cluster."""
        runs = [
            r
            for r in self.list_runs(model=model, cluster=cluster, status="succeeded")
            if r.verified and r.tokens_per_s is not None
        ]
        if not runs:
            return None
        return max(runs, key=lambda r: (r.tokens_per_s, r.measured_mfu or 0.0, r.started_at))

    def golden_run(self, spec_hash: str) -> RunRecord | None:
        """The run whose loss curve is the golden curve for a spec: its fastest verified run with metrics."""
        runs = [r for r in self.list_runs(spec_hash=spec_hash, status="succeeded") if r.verified and r.metrics_path]
        return max(runs, key=lambda r: (r.tokens_per_s or 0.0, r.started_at)) if runs else None

    def calibration(
        self, gpu_type: str, model_family_: str, *, lo: float = 0.25, hi: float = 1.5, min_runs: int = 1
    ) -> Calibration | None:
        """Median measured/predicted MFU over verified runs on `gpu_type` of `model_family_`, clipped to
        [lo, hi] so one odd run cannot swing the planner. None with fewer than `min_runs` usable runs."""
        return calibrate(self.list_runs(status="succeeded"), gpu_type, model_family_, lo=lo, hi=hi, min_runs=min_runs)

    # -- export

    def export_csv(self, path: str | Path | None = None, **filters: Any) -> str:
        """All (or filtered) runs as CSV, JSON columns as JSON text. Written atomically when `path` is given;
        the CSV text is returned either way."""
        text = runs_csv(self.list_runs(**filters))
        if path is not None:
            atomic_write_text(Path(path), text)
        return text


def calibration_for_spec(spec) -> Calibration | None:
    """The calibration a run of `spec` (a RunSpec) plans with: its ledger's verified runs on the same GPU type and
    model family (the keys the pipeline records, from the model it resolves). None on CPU, where the planner predicts
    nothing to calibrate."""
    if spec.cluster.gpu_type == "cpu":
        return None
    with Ledger(spec.ledger.url) as ledger:
        return ledger.calibration(spec.cluster.gpu_type, spec_run_model(spec).family)
