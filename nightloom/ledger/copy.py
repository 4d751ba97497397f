"""Copy a ledger into another database, nothing lost: a team's SQLite ledger (its runs and its night queues) into the
PostgreSQL it will share (`nightloom ledger copy --to postgresql+psycopg://...`).

Both ledgers are opened as any nightloom command opens them, so both are migrated to this nightloom's newest schema
first (the source keeps every row, as a migration does). Then every table the migrations made, as the database
itself lists them (the runs, the queues, their jobs and runs, and any table a later revision adds), is copied row
by row in one transaction on the target: a row whose primary key the target already holds with the same values
was copied before and is left alone (a second copy copies nothing), one held with other values is refused by
table and key, and a target holding rows the source does not is refused unless `merge` is asked for. Integer ids
keep their values, and the target's next id is set past the source's highest, removed jobs' ids included (the
queue never reuses an id). Afterwards every source row is read back from the target and compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Integer, MetaData, String, Table, func, select, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError

from nightloom.ledger.engine import where
from nightloom.ledger.migrations import LEGACY_TABLE, VERSION_TABLE
from nightloom.ledger.records import LedgerError
from nightloom.ledger.runs import Ledger

#: written by each ledger's own migration, never copied
MIGRATION_TABLES = frozenset({VERSION_TABLE, LEGACY_TABLE})


class CopyRefused(LedgerError):
    """The target holds rows the copy would contradict or mix with; the message names the tables and keys."""


@dataclass
class TableCopy:
    """One table's copy: the source's rows, how many were inserted and how many the target already held."""

    table: str
    rows: int
    copied: int = 0
    present: int = 0
    others: int = 0  # target rows the source does not hold (kept; refused without merge)


@dataclass
class CopyReport:
    source: str
    target: str
    tables: list[TableCopy] = field(default_factory=list)

    @property
    def copied(self) -> int:
        return sum(t.copied for t in self.tables)

    def lines(self) -> list[str]:
        """One line per table, then the total, for the command's output."""
        out = [
            f"{t.table}: {t.rows} rows, {t.copied} copied, {t.present} already there"
            + (f", {t.others} of the target's own kept" if t.others else "")
            for t in self.tables
        ]
        return [*out, f"{self.copied} rows copied from {self.source} to {self.target}"]


@dataclass
class _Plan:
    """What one table's copy will do: the rows to insert, the rows that contradict the target's."""

    table: Table
    keys: list[str]
    report: TableCopy
    missing: list[dict[str, Any]] = field(default_factory=list)
    conflicts: list[tuple] = field(default_factory=list)


def copy_ledger(source_url: str, target_url: str, *, merge: bool = False) -> CopyReport:
    """Copy the ledger at `source_url` into `target_url` (see the module's text); raise CopyRefused, and change
    nothing, when the target contradicts the source or (without `merge`) holds rows of its own."""
    if source_url == target_url:
        raise CopyRefused(f"the source and the target are the same ledger ({where(source_url)})")
    u = make_url(source_url)
    if u.get_backend_name() == "sqlite" and not Path(u.database or ":memory:").expanduser().is_file():
        raise LedgerError(f"no ledger at {where(source_url)}: the file does not exist")
    with Ledger(source_url) as src, Ledger(target_url) as dst:
        report = CopyReport(src.where(), dst.where())
        rows, high = _read_source(src.engine)
        tables = _tables(dst.engine, rows, src.where(), dst.where())
        try:
            dst.retry(lambda: _copy(dst.engine, tables, rows, high, merge, report))
        except IntegrityError as e:  # a writer added the same key meanwhile: nothing was copied
            raise CopyRefused(
                f"{dst.where()} was written to while copying ({type(e.orig).__name__}); nothing copied: stop its "
                "writers and run the copy again"
            ) from e
        with dst.engine.connect() as conn:  # read back: every source row there, with its values
            left = [p for p in _plans(conn, tables, rows) if p.missing or p.conflicts]
        if left:
            lost = "; ".join(f"{p.report.table}: {len(p.missing)} missing, {len(p.conflicts)} changed" for p in left)
            raise LedgerError(f"copy to {dst.where()} read back different: {lost}")
        return report


def _read_source(engine: Engine) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
    """Every row of every ledger table of the source, in primary-key order, and each integer id's high-water mark
    (SQLite's sqlite_sequence keeps ids handed out to rows since removed)."""
    md = MetaData()
    md.reflect(engine)
    rows: dict[str, list[dict[str, Any]]] = {}
    high: dict[str, int] = {}
    with engine.connect() as conn:
        for t in md.sorted_tables:
            if t.name in MIGRATION_TABLES:
                continue
            rows[t.name] = [dict(r._mapping) for r in conn.execute(select(t).order_by(*t.primary_key.columns))]
            ids = _serial_id(t)
            if ids is not None:
                handed = _sqlite_sequence(conn, t.name) or _pg_sequence(conn, t.name, ids)
                high[t.name] = max([r[ids] for r in rows[t.name]] + [handed])
    return rows, high


def _serial_id(t: Table) -> str | None:
    """The name of `t`'s single integer primary key (an id the database hands out), else None."""
    pk = list(t.primary_key.columns)
    return pk[0].name if len(pk) == 1 and isinstance(pk[0].type, Integer) else None


def _has_sqlite_sequence(conn: Connection) -> bool:
    """SQLite's table of AUTOINCREMENT high-water marks exists (once a table made with AUTOINCREMENT does)."""
    return conn.execute(text("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'")).first() is not None


def _sqlite_sequence(conn: Connection, table: str) -> int:
    """The highest id SQLite handed out in `table` (0 where it keeps none)."""
    if conn.dialect.name != "sqlite" or not _has_sqlite_sequence(conn):
        return 0
    got = conn.execute(text("SELECT seq FROM sqlite_sequence WHERE name = :t"), {"t": table}).first()
    return int(got[0]) if got else 0


def _pg_sequence(conn: Connection, table: str, column: str) -> int:
    """The last id PostgreSQL's sequence handed out in `table` (0 on another database, or before its first)."""
    if conn.dialect.name != "postgresql":
        return 0
    seq = conn.execute(text("SELECT pg_get_serial_sequence(:t, :c)"), {"t": table, "c": column}).scalar()
    if seq is None:
        return 0
    last, called = conn.execute(text(f"SELECT last_value, is_called FROM {seq}")).one()
    return int(last) if called else 0


def _tables(engine: Engine, rows: dict[str, list], source: str, target: str) -> list[Table]:
    """The target's tables the source's rows go to, parents before children; a source table the target lacks is
    refused by name (both are at the same schema, so only a table nightloom did not make can)."""
    md = MetaData()
    md.reflect(engine)
    strange = sorted(set(rows) - set(md.tables))
    if strange:
        raise CopyRefused(f"{source} holds table(s) {strange}, which {target} has not: not nightloom's; nothing copied")
    return [t for t in md.sorted_tables if t.name in rows]


def _plans(conn: Connection, tables: list[Table], rows: dict[str, list[dict[str, Any]]]) -> list[_Plan]:
    """Each table's rows compared with the target's by primary key."""
    out = []
    for t in tables:
        keys = [c.name for c in t.primary_key.columns]
        held = {tuple(r._mapping[k] for k in keys): dict(r._mapping) for r in conn.execute(select(t))}
        plan = _Plan(t, keys, TableCopy(t.name, len(rows[t.name])))
        for row in rows[t.name]:
            key = tuple(row[k] for k in keys)
            there = held.pop(key, None)
            if there is None:
                plan.missing.append(row)
            elif there != {c: row.get(c) for c in there}:
                plan.conflicts.append(key)
            else:
                plan.report.present += 1
        plan.report.others = len(held)
        out.append(plan)
    return out


def _copy(engine: Engine, tables, rows, high: dict[str, int], merge: bool, report: CopyReport) -> None:
    """One transaction: compare, refuse (nothing written), or insert what is missing and move the ids on."""
    with engine.begin() as conn:
        plans = _plans(conn, tables, rows)
        conflicts = [f"{p.report.table} {p.keys}={list(k)}" for p in plans for k in p.conflicts[:3]]
        if conflicts:
            raise CopyRefused(
                f"the target already holds other values for: {'; '.join(conflicts)}"
                " (a different ledger's rows under the same keys); nothing copied"
            )
        others = [f"{p.report.table} ({p.report.others})" for p in plans if p.report.others]
        if others and not merge:
            raise CopyRefused(
                f"the target already holds rows the source does not: {', '.join(others)}; "
                "copy into it anyway with --merge (its rows are kept); nothing copied"
            )
        for p in plans:
            _check_widths(p)
            if p.missing:
                conn.execute(p.table.insert(), p.missing)
            p.report.copied = len(p.missing)
            ids = _serial_id(p.table)
            if ids is not None:
                _advance_ids(conn, p.table, ids, high.get(p.table.name, 0))
        report.tables = [p.report for p in plans]


def _check_widths(p: _Plan) -> None:
    """SQLite keeps a string longer than its column's width; PostgreSQL refuses it: say which, where."""
    for col in p.table.columns:
        width = col.type.length if isinstance(col.type, String) else None
        for row in p.missing if width else []:
            value = row.get(col.name)
            if isinstance(value, str) and len(value) > width:
                key = [row[k] for k in p.keys]
                raise CopyRefused(
                    f"{p.table.name} {p.keys}={key}: {col.name} holds {len(value)} characters, the target's "
                    f"column {width}; nothing copied"
                )


def _advance_ids(conn: Connection, table: Table, column: str, high: int) -> None:
    """The target's next id past `high` and past every id in the table, never moved back: PostgreSQL's sequence,
    SQLite's sqlite_sequence (a table made with AUTOINCREMENT)."""
    top = max(high, conn.execute(select(func.max(table.c[column]))).scalar() or 0)
    if conn.dialect.name == "sqlite":
        if _has_sqlite_sequence(conn) and top > _sqlite_sequence(conn, table.name):
            conn.execute(text("DELETE FROM sqlite_sequence WHERE name = :t"), {"t": table.name})
            conn.execute(text("INSERT INTO sqlite_sequence (name, seq) VALUES (:t, :v)"), {"t": table.name, "v": top})
        return
    seq = conn.execute(text("SELECT pg_get_serial_sequence(:t, :c)"), {"t": table.name, "c": column}).scalar()
    if seq is not None and top > _pg_sequence(conn, table.name, column):
        conn.execute(text("SELECT setval(:s, :v, true)"), {"s": seq, "v": top})
