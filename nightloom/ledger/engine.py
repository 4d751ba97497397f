"""The ledger's storage: the runs table (SQLAlchemy ORM), opening an engine, the Alembic bootstrap, SQLite retries.

SQLite (the default) is made safe for several writers at once: WAL journal, a busy timeout, every transaction
opened with BEGIN IMMEDIATE (so a read-modify-write such as `record_interruption` is atomic), and retries on
"database is locked". PostgreSQL (`postgresql+psycopg://`, a team's shared ledger) takes the row with
SELECT ... FOR UPDATE for the same read-modify-write, and a transaction that meets a serialization failure or a
deadlock (SQLSTATE 40001, 40P01) is run again (`retry`). A SQLite file on a network filesystem, where its locks
are unsafe, is warned about when opened (`network_filesystem`).
The schema is migrated by Alembic (scripts in nightloom/ledger/migrations/) when the ledger is opened, in one
transaction: a new ledger is built at the newest revision, a ledger from before Alembic (an integer in
`nightloom_schema`, no version table) is stamped at its revision and upgraded, a newer ledger is refused. On
PostgreSQL that transaction first takes an advisory lock, so writers opening a new ledger at once migrate it once.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import JSON, Connection, DateTime, Float, Integer, String, create_engine, event, inspect, select, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from nightloom.ledger.migrations import LEGACY_TABLE, SCRIPT_DIR, VERSION_TABLE
from nightloom.ledger.records import LedgerError, RunRecord

SCHEMA_VERSION = 7  # the newest; 2: `nights`; 3: the night queue (queue_store); 4: its runs; 5: preemptions; 6: family;
# 7: task and figures

T = TypeVar("T")
log = logging.getLogger(__name__)

RETRY_SQLSTATES = {"40001": "serialization failure", "40P01": "deadlock detected"}  # PostgreSQL: run it again
MOUNTS = Path("/proc/self/mounts")  # this process's mount table: device, mount point, type, ...
MIGRATION_LOCK = 0x6E6C_6C65_6467_6572  # pg_advisory_xact_lock key of the migration ("nlledger")
NETWORK_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs"}
    | {"fuse.sshfs", "fuse.s3fs", "fuse.glusterfs", "fuse.cephfs", "fuse.gcsfuse", "fuse.juicefs", "fuse.rclone"}
)


# ---------------------------------------------------------------------------------------------- tables


class UTCDateTime(TypeDecorator):
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


class Base(DeclarativeBase):
    """The ledger's runs table and version row (the night queue's tables have their own base, queue_store)."""


class SchemaVersionRow(Base):
    """The version row nightloom kept before Alembic; each revision still writes its number here (see
    nightloom/ledger/migrations), so an older nightloom refuses a newer ledger."""

    __tablename__ = LEGACY_TABLE
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)


class RunRow(Base):
    __tablename__ = "nightloom_runs"
    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(128), index=True)
    family: Mapped[str] = mapped_column(String(64), server_default="")
    task: Mapped[str] = mapped_column(String(16), server_default="")
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
    figures: Mapped[Any | None] = mapped_column(JSON, nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(String(2048))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    interruptions: Mapped[Any] = mapped_column(JSON)
    interruption_count: Mapped[int] = mapped_column(Integer)
    recovery_s: Mapped[float] = mapped_column(Float)
    preemptions: Mapped[int] = mapped_column(Integer, server_default="0")
    preemption_lost_s: Mapped[float] = mapped_column(Float, server_default="0")
    metrics_path: Mapped[str | None] = mapped_column(String(1024))
    nights: Mapped[Any | None] = mapped_column(JSON, nullable=True)


RUN_COLUMNS = tuple(c.name for c in RunRow.__table__.columns)
APPENDED = {"interruptions", "interruption_count", "recovery_s", "preemptions", "preemption_lost_s"}  # by record_*
MUTABLE = frozenset(RUN_COLUMNS) - {"run_id", "nights", *APPENDED}
assert set(RUN_COLUMNS) == set(RunRecord.model_fields), "ledger table and RunRecord drifted apart"


def to_row(rec: RunRecord) -> dict[str, Any]:
    d = rec.model_dump(mode="python")
    d["plan"] = rec.plan.model_dump(mode="json") if rec.plan else None
    d["verdicts"] = [v.model_dump(mode="json") for v in rec.verdicts]
    d["figures"] = [f.model_dump(mode="json") for f in rec.figures]
    d["interruptions"] = [i.model_dump(mode="json") for i in rec.interruptions]
    d["nights"] = [n.model_dump(mode="json") for n in rec.nights]
    return d


def from_row(row: RunRow) -> RunRecord:
    d = {c: getattr(row, c) for c in RUN_COLUMNS}
    d["nights"] = d["nights"] or []  # rows migrated from schema 1 hold NULL
    d["figures"] = d["figures"] or []  # rows migrated from schema 6 hold NULL
    return RunRecord.model_validate(d)


def revision(version: int) -> str:
    """Schema version → Alembic revision id: 2 → '0002'."""
    return f"{version:04d}"


@functools.cache
def migration_scripts() -> ScriptDirectory:
    """The migration scripts shipped in the package (loaded once per process)."""
    return ScriptDirectory(str(SCRIPT_DIR))


def alembic_config(conn: Connection) -> Config:
    """An Alembic config whose env.py migrates `conn`, inside the transaction the caller holds."""
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_DIR))
    cfg.attributes["connection"] = conn
    return cfg


def current_revisions(conn: Connection) -> tuple[str, ...]:
    """The ledger's Alembic revision(s); () for a ledger without the version table (new, or from before Alembic)."""
    ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return tuple(ctx.get_current_heads())


# ---------------------------------------------------------------------------------------------- opening


def open_engine(url: str, busy_timeout_s: float) -> Engine:
    """An engine on `url` (a SQLite file's folder is created, and warned about on a network filesystem; SQLite gets
    the pragmas above; a server's connections are checked before use, as one may have restarted since)."""
    u = make_url(url)
    sqlite = u.get_backend_name() == "sqlite"
    if sqlite and u.database and u.database != ":memory:":
        folder = Path(u.database).expanduser().parent
        folder.mkdir(parents=True, exist_ok=True)
        fs = network_filesystem(folder)
        if fs:
            log.warning(
                "ledger %s: a SQLite file on a network filesystem (%s), where SQLite's locks are unsafe and "
                "concurrent writers can corrupt it: a team's shared ledger belongs on PostgreSQL "
                "(ledger.url: postgresql+psycopg://..., docs/operations.md)",
                where(url),
                fs,
            )
    if sqlite:
        engine = create_engine(url, connect_args={"timeout": busy_timeout_s})
        sqlite_pragmas(engine, busy_timeout_s)
    else:
        engine = create_engine(url, pool_pre_ping=True)
    return engine


def network_filesystem(path: Path, mounts: str | None = None) -> str | None:
    """The type of the network filesystem `path` lives on (`nfs4`, `cifs`, `fuse.sshfs`, ...), None on a local
    one. `mounts` is the text of the mount table (MOUNTS when not given): the longest mount point above it wins."""
    if mounts is None:
        try:
            mounts = MOUNTS.read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, fstype = "", ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype if fstype in NETWORK_FS else None


def where(url: str) -> str:
    """The ledger's URL as shown in messages (password hidden)."""
    return make_url(url).render_as_string(hide_password=True)


def transient(e: DBAPIError) -> bool:
    """A failure the same transaction, run again, may not meet: SQLite's "database is locked"/busy, PostgreSQL's
    serialization failure or deadlock (RETRY_SQLSTATES; psycopg gives the SQLSTATE as `sqlstate`)."""
    if getattr(e.orig, "sqlstate", None) in RETRY_SQLSTATES:
        return True
    msg = str(e.orig).lower()
    return isinstance(e, OperationalError) and ("locked" in msg or "busy" in msg)


def retry(fn: Callable[[], T], retries: int) -> T:
    """Run one transaction `fn`, running it again after a transient failure (`transient`) with jittered backoff.
    `fn` opens and ends its own transaction, so a retry starts from a clean one."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except DBAPIError as e:
            if attempt == retries or not transient(e):
                raise
            time.sleep(min(1.0, 0.01 * 2**attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")  # pragma: no cover


def migrate(engine: Engine, url: str) -> None:
    """Bring the ledger to the newest revision, in one transaction (on SQLite BEGIN IMMEDIATE: one process
    migrates while the others wait, then find it done)."""
    scripts = migration_scripts()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":  # one migrates, the others wait here and then find it done
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        cfg = alembic_config(conn)
        revs = current_revisions(conn)
        if not revs:
            legacy = _legacy_version(conn, url)
            if legacy is not None:  # written before Alembic: record what it is, then migrate from there
                command.stamp(cfg, revision(legacy))
                revs = (revision(legacy),)
        known = {s.revision for s in scripts.walk_revisions()}
        for rev in revs:
            if rev not in known:
                raise LedgerError(
                    f"ledger {where(url)} is at schema revision {rev!r}, which this nightloom does not know "
                    f"(its newest is {scripts.get_current_head()!r}): upgrade nightloom"
                )
        if set(revs) != {scripts.get_current_head()}:
            command.upgrade(cfg, "head")


def _legacy_version(conn: Connection, url: str) -> int | None:
    """The integer schema version of a ledger from before Alembic; None for an empty database."""
    tables = set(inspect(conn).get_table_names())
    if LEGACY_TABLE not in tables:
        if RunRow.__tablename__ in tables:
            raise LedgerError(
                f"ledger {where(url)} has a {RunRow.__tablename__} table but no schema version "
                f"({VERSION_TABLE} or {LEGACY_TABLE}): not a ledger "
                "nightloom wrote"
            )
        return None
    version = conn.execute(select(SchemaVersionRow.version).where(SchemaVersionRow.id == 1)).scalar_one_or_none()
    if version is None or version < 1:
        raise LedgerError(f"ledger {where(url)} has no valid version in {LEGACY_TABLE}")
    if version > SCHEMA_VERSION:
        raise LedgerError(
            f"ledger {where(url)} has schema version {version}; this nightloom understands up to "
            f"{SCHEMA_VERSION}: upgrade nightloom"
        )
    return version


def sqlite_pragmas(engine: Engine, busy_timeout_s: float) -> None:
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
