"""The run ledger: one row per run (layout, predicted vs measured MFU, times, cost, verdicts), any SQLAlchemy URL.

SQLite (the default) is made safe for several writers at once: WAL journal, a busy timeout, every transaction
opened with BEGIN IMMEDIATE (so a read-modify-write such as `record_interruption` is atomic), and retries on
"database is locked". Other databases use SELECT ... FOR UPDATE for the same read-modify-write.
`calibration_for_spec` reads it back for the planner (tasks/plan.py): the median measured/predicted MFU of
verified runs on the same GPU type and model family scales the planner's efficiency factor, within bounds
(not on CPU, where the planner predicts no MFU). A row's model and family are the model the run trained
(nightloom/ledger_model.py), not the spec's catalog name.
The schema is migrated by Alembic (scripts in nightloom/ledger_migrations/) when the ledger is opened, in one
transaction: a new ledger is built at the newest revision, a ledger from before Alembic (an integer in
`nightloom_schema`, no version table) is stamped at its revision and upgraded, a newer ledger is refused.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import random
import statistics
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import JSON, Connection, DateTime, Float, Integer, String, create_engine, event, inspect, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.types import TypeDecorator

from nightloom import ledger_migrations
from nightloom.ledger_model import model_family, spec_run_model
from nightloom.parallel import ParallelPlan
from nightloom.util import atomic_write_text
from nightloom.validate import Verdict, gated

SCHEMA_VERSION = 6  # the newest; 2: `nights`; 3: the night queue (queue_store); 4: its runs; 5: preemptions; 6: family
RunStatus = Literal["running", "succeeded", "failed", "cancelled", "stopped", "deferred", "refused"]
RUN_STATUSES: tuple[str, ...] = RunStatus.__args__  # type: ignore[attr-defined]

T = TypeVar("T")


class LedgerError(RuntimeError):
    """A ledger that cannot be used (newer schema, unknown run id, bad field); the message says which."""


# ---------------------------------------------------------------------------------------------- records


class Interruption(BaseModel):
    """One failed attempt that recovery handled (`kind`: node, network or transient, from the preflight re-run
    after it), how long recovery took, the time lost and its cost. A split run's window ends are nights."""

    model_config = ConfigDict(extra="forbid")
    at: datetime
    kind: str
    detail: str = ""
    recovery_s: float | None = None
    lost_s: float | None = None  # wall time lost: detection + recovery + steps redone since the checkpoint
    cost: float | None = None  # what the lost time cost (GPUs × lost_s at the schedule's price)


class NightRecord(BaseModel):
    """One night (one stretch of renting) of a run: what the plan predicted for it and what it did and cost."""

    model_config = ConfigDict(extra="forbid")
    night: int  # 1-based
    start: datetime
    end: datetime
    steps: int  # trained this night
    steps_done: int  # at the end of this night (the checkpoint it left)
    cost: float  # actual, from the billing spans
    stopped: str = ""  # completed | window | budget | failed ...
    predicted_steps: int | None = None
    predicted_cost: float | None = None
    uncertainty: float | None = None  # ± on predicted_cost
    predicted_nights: int | None = None  # the whole run's, as planned at this night's start
    predicted_finish: datetime | None = None


class RunRecord(BaseModel):
    """One ledger row, typed."""

    model_config = ConfigDict(extra="forbid")
    run_id: str
    spec_hash: str
    name: str
    model: str  # the model the run trained (nightloom.ledger_model.run_model), e.g. chat-sft-demo-qwen2
    family: str = ""  # its family, the calibration's key (qwen2, llama2, ...); "" = the family of `model`'s name
    cluster: str
    provider: str
    gpu_type: str
    world_size: int
    layout: str | None = None
    plan: ParallelPlan | None = None
    predicted_mfu: float | None = None
    measured_mfu: float | None = None
    hfu: float | None = None
    tokens_per_s: float | None = None
    final_loss: float | None = None
    time_to_ready_s: float | None = None
    duration_s: float | None = None
    cost: float | None = None
    currency: str = "USD"
    precision: str | None = None
    peak_source: str | None = None
    verdicts: list[Verdict] = Field(default_factory=list)
    status: RunStatus = "running"
    reason: str | None = None
    started_at: datetime
    finished_at: datetime | None = None
    interruptions: list[Interruption] = Field(default_factory=list)
    interruption_count: int = 0  # failures; preemptions are counted apart (their items are in `interruptions`)
    recovery_s: float = 0.0
    preemptions: int = 0
    preemption_lost_s: float = 0.0
    metrics_path: str | None = None
    nights: list[NightRecord] = Field(default_factory=list)

    @property
    def verified(self) -> bool:
        """Succeeded, at least one gate ran (a run whose every gate was skipped proves nothing), and every gate
        passed."""
        return self.status == "succeeded" and bool(gated(self.verdicts)) and all(v.passed for v in self.verdicts)

    @model_validator(mode="after")
    def _family_of_name(self) -> Self:
        """A row or caller that names no family gets its model name's (`llama2-70b` → `llama2`)."""
        self.family = self.family or model_family(self.model)
        return self


class Calibration(BaseModel):
    """measured/predicted MFU of past verified runs: the factor the planner multiplies its prediction by."""

    model_config = ConfigDict(extra="forbid")
    gpu_type: str
    model_family: str
    factor: float
    raw_median: float
    runs: int
    clipped: bool


def calibration_for_spec(spec) -> Calibration | None:
    """The calibration a run of `spec` (a RunSpec) plans with: its ledger's verified runs on the same GPU type and
    model family (the keys the pipeline records, from the model it resolves). None on CPU, where the planner predicts
    nothing to calibrate."""
    if spec.cluster.gpu_type == "cpu":
        return None
    with Ledger(spec.ledger.url) as ledger:
        return ledger.calibration(spec.cluster.gpu_type, spec_run_model(spec).family)


# ---------------------------------------------------------------------------------------------- schema


class _UTC(TypeDecorator):
    """Aware datetimes in, aware UTC out (SQLite has no time zones)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise LedgerError(f"naive datetime {value.isoformat()}: give a timezone-aware time")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value, dialect):
        return None if value is None else value.replace(tzinfo=UTC)


class _Base(DeclarativeBase):
    pass


class _SchemaVersion(_Base):
    """The version row nightloom kept before Alembic; each revision still writes its number here (see
    nightloom/ledger_migrations), so an older nightloom refuses a newer ledger."""

    __tablename__ = ledger_migrations.LEGACY_TABLE
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)


class _Run(_Base):
    __tablename__ = "nightloom_runs"
    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(128), index=True)
    family: Mapped[str] = mapped_column(String(64), server_default="")
    cluster: Mapped[str] = mapped_column(String(128), index=True)
    provider: Mapped[str] = mapped_column(String(32))
    gpu_type: Mapped[str] = mapped_column(String(64), index=True)
    world_size: Mapped[int] = mapped_column(Integer)
    layout: Mapped[str | None] = mapped_column(String(128))
    plan: Mapped[Any | None] = mapped_column(JSON)
    predicted_mfu: Mapped[float | None] = mapped_column(Float)
    measured_mfu: Mapped[float | None] = mapped_column(Float)
    hfu: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    final_loss: Mapped[float | None] = mapped_column(Float)
    time_to_ready_s: Mapped[float | None] = mapped_column(Float)
    duration_s: Mapped[float | None] = mapped_column(Float)
    cost: Mapped[float | None] = mapped_column(Float)
    currency: Mapped[str] = mapped_column(String(8))
    precision: Mapped[str | None] = mapped_column(String(16))
    peak_source: Mapped[str | None] = mapped_column(String(512))
    verdicts: Mapped[Any] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(String(2048))
    started_at: Mapped[datetime] = mapped_column(_UTC)
    finished_at: Mapped[datetime | None] = mapped_column(_UTC)
    interruptions: Mapped[Any] = mapped_column(JSON)
    interruption_count: Mapped[int] = mapped_column(Integer)
    recovery_s: Mapped[float] = mapped_column(Float)
    preemptions: Mapped[int] = mapped_column(Integer, server_default="0")
    preemption_lost_s: Mapped[float] = mapped_column(Float, server_default="0")
    metrics_path: Mapped[str | None] = mapped_column(String(1024))
    nights: Mapped[Any | None] = mapped_column(JSON, nullable=True)


_COLUMNS = tuple(c.name for c in _Run.__table__.columns)
_APPENDED = {"interruptions", "interruption_count", "recovery_s", "preemptions", "preemption_lost_s"}  # by record_*
_MUTABLE = frozenset(_COLUMNS) - {"run_id", "nights", *_APPENDED}
assert set(_COLUMNS) == set(RunRecord.model_fields), "ledger table and RunRecord drifted apart"


def _to_row(rec: RunRecord) -> dict[str, Any]:
    d = rec.model_dump(mode="python")
    d["plan"] = rec.plan.model_dump(mode="json") if rec.plan else None
    d["verdicts"] = [v.model_dump(mode="json") for v in rec.verdicts]
    d["interruptions"] = [i.model_dump(mode="json") for i in rec.interruptions]
    d["nights"] = [n.model_dump(mode="json") for n in rec.nights]
    return d


def _from_row(row: _Run) -> RunRecord:
    d = {c: getattr(row, c) for c in _COLUMNS}
    d["nights"] = d["nights"] or []  # rows migrated from schema 1 hold NULL
    return RunRecord.model_validate(d)


def _revision(version: int) -> str:
    """Schema version → Alembic revision id: 2 → '0002'."""
    return f"{version:04d}"


@functools.cache
def _scripts() -> ScriptDirectory:
    """The migration scripts shipped in the package (loaded once per process)."""
    return ScriptDirectory(str(ledger_migrations.SCRIPT_DIR))


def _alembic_config(conn: Connection) -> Config:
    """An Alembic config whose env.py migrates `conn`, inside the transaction the caller holds."""
    cfg = Config()
    cfg.set_main_option("script_location", str(ledger_migrations.SCRIPT_DIR))
    cfg.attributes["connection"] = conn
    return cfg


def _current_revisions(conn: Connection) -> tuple[str, ...]:
    """The ledger's Alembic revision(s); () for a ledger without the version table (new, or from before Alembic)."""
    ctx = MigrationContext.configure(conn, opts={"version_table": ledger_migrations.VERSION_TABLE})
    return tuple(ctx.get_current_heads())


# ---------------------------------------------------------------------------------------------- the ledger


class Ledger:
    """Open (and create or check the schema of) the ledger at `url`. Safe to use from several processes."""

    def __init__(self, url: str, *, busy_timeout_s: float = 30.0, retries: int = 20):
        self.url = url
        self.retries = retries
        u = make_url(url)
        self._sqlite = u.get_backend_name() == "sqlite"
        if self._sqlite and u.database and u.database != ":memory:":
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.engine: Engine = create_engine(url, connect_args={"timeout": busy_timeout_s} if self._sqlite else {})
        if self._sqlite:
            _sqlite_pragmas(self.engine, busy_timeout_s)
        self._retry(self._init_schema)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing

    def _retry(self, fn: Callable[[], T]) -> T:
        """Run one transaction, retrying on SQLite lock/busy errors with jittered backoff."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except OperationalError as e:
                msg = str(e.orig).lower()
                if attempt == self.retries or not ("locked" in msg or "busy" in msg):
                    raise
                time.sleep(min(1.0, 0.01 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")  # pragma: no cover

    def _init_schema(self) -> None:
        """Bring the ledger to the newest revision, in one transaction (on SQLite BEGIN IMMEDIATE: one process
        migrates while the others wait, then find it done)."""
        scripts = _scripts()
        with self.engine.begin() as conn:
            cfg = _alembic_config(conn)
            revs = _current_revisions(conn)
            if not revs:
                legacy = self._legacy_version(conn)
                if legacy is not None:  # written before Alembic: record what it is, then migrate from there
                    command.stamp(cfg, _revision(legacy))
                    revs = (_revision(legacy),)
            known = {s.revision for s in scripts.walk_revisions()}
            for rev in revs:
                if rev not in known:
                    raise LedgerError(
                        f"ledger {self._where()} is at schema revision {rev!r}, which this nightloom does not know "
                        f"(its newest is {scripts.get_current_head()!r}): upgrade nightloom"
                    )
            if set(revs) != {scripts.get_current_head()}:
                command.upgrade(cfg, "head")

    def _legacy_version(self, conn: Connection) -> int | None:
        """The integer schema version of a ledger from before Alembic; None for an empty database."""
        tables = set(inspect(conn).get_table_names())
        if ledger_migrations.LEGACY_TABLE not in tables:
            if _Run.__tablename__ in tables:
                raise LedgerError(
                    f"ledger {self._where()} has a {_Run.__tablename__} table but no schema version "
                    f"({ledger_migrations.VERSION_TABLE} or {ledger_migrations.LEGACY_TABLE}): not a ledger "
                    "nightloom wrote"
                )
            return None
        version = conn.execute(select(_SchemaVersion.version).where(_SchemaVersion.id == 1)).scalar_one_or_none()
        if version is None or version < 1:
            raise LedgerError(f"ledger {self._where()} has no valid version in {ledger_migrations.LEGACY_TABLE}")
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"ledger {self._where()} has schema version {version}; this nightloom understands up to "
                f"{SCHEMA_VERSION}: upgrade nightloom"
            )
        return version

    def _where(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def schema_version(self) -> int:
        """The ledger's schema version: the number of its Alembic revision ('0002' → 2)."""
        with self.engine.connect() as conn:
            return int(_current_revisions(conn)[0])

    def _modify(self, run_id: str, change: Callable[[_Run], None]) -> RunRecord:
        def tx() -> RunRecord:
            with Session(self.engine, expire_on_commit=False) as s, s.begin():
                row = s.execute(select(_Run).where(_Run.run_id == run_id).with_for_update()).scalar_one_or_none()
                if row is None:
                    raise LedgerError(f"no run {run_id!r} in the ledger {self._where()}")
                change(row)
                s.flush()
                rec = _from_row(row)
            return rec

        return self._retry(tx)

    # -- writes

    def start_run(
        self,
        *,
        run_id: str,
        spec_hash: str,
        name: str,
        model: str,
        cluster: str,
        family: str = "",
        provider: str,
        gpu_type: str,
        world_size: int,
        plan: ParallelPlan | None = None,
        predicted_mfu: float | None = None,
        started_at: datetime | None = None,
        status: RunStatus = "running",
        currency: str = "USD",
        metrics_path: str | None = None,
        time_to_ready_s: float | None = None,
    ) -> RunRecord:
        """Insert the run's row (status `running` unless given). A duplicate run id is an error."""
        if predicted_mfu is None and plan is not None:
            predicted_mfu = plan.mfu
        rec = RunRecord(
            run_id=run_id,
            spec_hash=spec_hash,
            name=name,
            model=model,
            family=family,
            cluster=cluster,
            provider=provider,
            gpu_type=gpu_type,
            world_size=world_size,
            plan=plan,
            layout=plan.layout() if plan else None,
            predicted_mfu=predicted_mfu,
            started_at=started_at or datetime.now(UTC),
            status=status,
            currency=currency,
            metrics_path=metrics_path,
            time_to_ready_s=time_to_ready_s,
        )

        def tx() -> None:
            with Session(self.engine) as s, s.begin():
                s.add(_Run(**_to_row(rec)))

        try:
            self._retry(tx)
        except IntegrityError:
            raise LedgerError(f"run {run_id!r} is already in the ledger {self._where()}") from None
        return self.get(run_id)

    def update_run(self, run_id: str, **fields: Any) -> RunRecord:
        """Set some fields of a run; names and types are checked against RunRecord."""
        bad = set(fields) - _MUTABLE
        if bad:
            raise LedgerError(f"update_run({run_id!r}): cannot set {sorted(bad)}; settable: {sorted(_MUTABLE)}")
        if "plan" in fields and fields["plan"] is not None and "layout" not in fields:
            fields["layout"] = ParallelPlan.model_validate(fields["plan"]).layout()

        def change(row: _Run) -> None:
            merged = _from_row(row).model_dump() | fields
            rec = RunRecord.model_validate(merged)  # type check before writing
            new = _to_row(rec)
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
        }
        fields = {k: v for k, v in given.items() if v is not None}
        return self.update_run(run_id, status=status, finished_at=finished_at or datetime.now(UTC), **fields)

    def record_interruption(
        self,
        run_id: str,
        *,
        kind: str,
        detail: str = "",
        recovery_s: float | None = None,
        at: datetime | None = None,
        lost_s: float | None = None,
        cost: float | None = None,
    ) -> RunRecord:
        """Append an interruption and add its recovery time (atomic under concurrent writers)."""
        item = Interruption(
            at=at or datetime.now(UTC), kind=kind, detail=detail, recovery_s=recovery_s, lost_s=lost_s, cost=cost
        )

        def change(row: _Run) -> None:
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

        def change(row: _Run) -> None:
            nights = [*(row.nights or []), night.model_dump(mode="json")]
            row.nights = nights
            row.cost = sum(n["cost"] for n in nights)

        return self._modify(run_id, change)

    # -- reads

    def get(self, run_id: str) -> RunRecord:
        def tx() -> RunRecord:
            with Session(self.engine) as s:
                row = s.get(_Run, run_id)
                if row is None:
                    raise LedgerError(f"no run {run_id!r} in the ledger {self._where()}")
                return _from_row(row)

        return self._retry(tx)

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
        q = select(_Run).order_by(_Run.started_at.desc(), _Run.run_id)
        for col, val in (
            (_Run.model, model),
            (_Run.cluster, cluster),
            (_Run.status, status),
            (_Run.spec_hash, spec_hash),
        ):
            if val is not None:
                q = q.where(col == val)
        if limit is not None:
            q = q.limit(limit)

        def tx() -> list[RunRecord]:
            with Session(self.engine) as s:
                return [_from_row(r) for r in s.execute(q).scalars()]

        return self._retry(tx)

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
        ratios = [
            r.measured_mfu / r.predicted_mfu
            for r in self.list_runs(status="succeeded")
            if r.verified
            and r.gpu_type == gpu_type
            and r.family == model_family_
            and r.measured_mfu
            and r.predicted_mfu
            and r.predicted_mfu > 0
        ]
        if len(ratios) < min_runs or not ratios:
            return None
        raw = statistics.median(ratios)
        factor = min(hi, max(lo, raw))
        return Calibration(
            gpu_type=gpu_type,
            model_family=model_family_,
            factor=factor,
            raw_median=raw,
            runs=len(ratios),
            clipped=factor != raw,
        )

    # -- export

    def export_csv(self, path: str | Path | None = None, **filters: Any) -> str:
        """All (or filtered) runs as CSV, JSON columns as JSON text. Written atomically when `path` is given;
        the CSV text is returned either way."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(_COLUMNS), lineterminator="\n")
        w.writeheader()
        for rec in self.list_runs(**filters):
            row = _to_row(rec)
            for k in ("plan", "verdicts", "interruptions", "nights"):
                row[k] = json.dumps(row[k], sort_keys=True) if row[k] is not None else ""
            for k in ("started_at", "finished_at"):
                row[k] = row[k].isoformat() if row[k] is not None else ""
            w.writerow(row)
        text = buf.getvalue()
        if path is not None:
            atomic_write_text(Path(path), text)
        return text


def _sqlite_pragmas(engine: Engine, busy_timeout_s: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # let SQLAlchemy's "begin" event issue BEGIN itself
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
