"""Preemptions in the ledger (schema 5): a ledger written at schema 4 opens with its rows whole and gains the two
counters at 0; a preemption is kept in `interruptions` but counted apart from failures, with its time lost."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from sqlalchemy import create_engine

from nightloom.ledger import SCHEMA_VERSION, Ledger
from nightloom.ledger import engine as ledger_mod
from nightloom.ledger import migrations as ledger_migrations

#: a run row as a schema-4 nightloom wrote it (every column it had)
ROW4 = {
    "run_id": "old",
    "spec_hash": "abc",
    "name": "n",
    "model": "tiny",
    "cluster": "local",
    "provider": "local",
    "gpu_type": "cpu",
    "world_size": 2,
    "currency": "USD",
    "verdicts": "[]",
    "status": "succeeded",
    "started_at": "2026-06-02 02:00:00.000000",
    "interruptions": '[{"at": "2026-06-02T02:10:00Z", "kind": "node", "detail": "x", "recovery_s": 3.0}]',
    "interruption_count": 1,
    "recovery_s": 3.0,
}


def sql(db: Path, statement: str, *params) -> list[tuple]:
    with closing(sqlite3.connect(db)) as con, con:
        return con.execute(statement, params).fetchall()


def test_a_schema_4_ledger_opens_whole_and_counts_preemptions_apart(tmp_path: Path):
    db = tmp_path / "v4.db"
    url = f"sqlite:///{db}"
    eng = create_engine(url)
    with eng.begin() as conn:
        command.upgrade(ledger_mod.alembic_config(conn), "0004")
    eng.dispose()
    cols = ", ".join(f'"{c}"' for c in ROW4)
    sql(db, f"INSERT INTO nightloom_runs ({cols}) VALUES ({', '.join('?' * len(ROW4))})", *ROW4.values())
    assert "preemptions" not in [r[1] for r in sql(db, "PRAGMA table_info(nightloom_runs)")]

    with Ledger(url) as lg:
        assert lg.schema_version() == SCHEMA_VERSION == 7
        old = lg.get("old")
        assert (old.preemptions, old.preemption_lost_s) == (0, 0.0)
        assert old.interruption_count == 1 and old.recovery_s == 3.0 and old.interruptions[0].kind == "node"
        at = datetime(2026, 6, 2, 3, tzinfo=UTC)
        lg.record_interruption(
            "old", kind="preemption", detail="stopped at step 4/30", recovery_s=9.0, lost_s=9.5, at=at
        )
        row = lg.record_interruption("old", kind="preemption", detail="stopped at step 9/30", lost_s=2.0, at=at)
    assert (row.preemptions, row.preemption_lost_s) == (2, 11.5)
    assert row.interruption_count == 1 and row.recovery_s == 3.0  # failures only
    assert [i.kind for i in row.interruptions] == ["node", "preemption", "preemption"]
    assert sql(db, f"SELECT version_num FROM {ledger_migrations.VERSION_TABLE}") == [("0007",)]
    assert sql(db, "SELECT version FROM nightloom_schema") == [(7,)]

    # and back: schema 4 drops the counters, keeps the row
    eng = create_engine(url)
    with eng.begin() as conn:
        command.downgrade(ledger_mod.alembic_config(conn), "0004")
    eng.dispose()
    assert sql(db, "SELECT run_id, interruption_count FROM nightloom_runs") == [("old", 1)]
