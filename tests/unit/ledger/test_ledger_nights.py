"""The ledger's per-night records (schema 2) and the migration that opens a schema-1 ledger in place."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime, timedelta

import pytest

from nightloom.ledger import SCHEMA_VERSION, Ledger, NightRecord

T0 = datetime(2026, 6, 1, 18, 0, tzinfo=UTC)


def start(lg: Ledger, run_id: str = "r1"):
    return lg.start_run(
        run_id=run_id,
        spec_hash="s",
        name="n",
        model="tiny",
        cluster="c",
        provider="local",
        gpu_type="cpu",
        world_size=2,
        started_at=T0,
    )


def night(i: int, cost: float, steps_done: int) -> NightRecord:
    return NightRecord(
        night=i,
        start=T0 + timedelta(days=i - 1),
        end=T0 + timedelta(days=i - 1, hours=4),
        steps=steps_done - 10 * (i - 1),
        steps_done=steps_done,
        cost=cost,
        stopped="window",
        predicted_cost=cost + 0.5,
        uncertainty=1.0,
    )


def test_nights_append_and_sum_into_the_run_cost(ledger_url):
    with Ledger(ledger_url) as lg:
        start(lg)
        lg.record_night("r1", night(1, 3.0, 10))
        row = lg.record_night("r1", night(2, 4.5, 20))
        assert [n.night for n in row.nights] == [1, 2] and row.cost == pytest.approx(7.5)
        assert row.nights[1].predicted_cost == pytest.approx(5.0) and row.nights[1].start == T0 + timedelta(days=1)
        assert '"night": 2' in lg.export_csv().replace('""', '"')


def test_a_schema_1_ledger_is_migrated_and_keeps_its_rows(tmp_path):
    db = tmp_path / "old.db"
    url = f"sqlite:///{db}"
    with Ledger(url) as lg:
        start(lg, "old-run")
        lg.finish_run("old-run", status="succeeded", cost=12.5)
    # make it what nightloom with schema 1 wrote: no `nights` column, version 1, no Alembic version table
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE nightloom_runs DROP COLUMN nights")
    con.execute("ALTER TABLE nightloom_runs DROP COLUMN preemptions")  # schema 5's
    con.execute("ALTER TABLE nightloom_runs DROP COLUMN preemption_lost_s")
    con.execute("ALTER TABLE nightloom_runs DROP COLUMN family")  # schema 6's
    con.execute("ALTER TABLE nightloom_runs DROP COLUMN task")  # schema 7's
    con.execute("ALTER TABLE nightloom_runs DROP COLUMN figures")
    con.execute("UPDATE nightloom_schema SET version = 1")
    con.execute("DROP TABLE nightloom_alembic_version")
    con.execute("DROP TABLE nightloom_queue_runs")  # schema 3's and 4's queue tables did not exist either
    con.execute("DROP TABLE nightloom_queue_jobs")
    con.execute("DROP TABLE nightloom_queues")
    con.commit()
    assert "nights" not in [r[1] for r in con.execute("PRAGMA table_info(nightloom_runs)")]
    con.close()

    with Ledger(url) as lg:
        assert lg.schema_version() == SCHEMA_VERSION == 7
        old = lg.get("old-run")
        assert old.status == "succeeded" and old.cost == 12.5 and old.nights == []
        row = lg.record_night("old-run", night(1, 2.0, 10))
        assert len(row.nights) == 1
    con = sqlite3.connect(db)
    assert "nights" in [r[1] for r in con.execute("PRAGMA table_info(nightloom_runs)")]
    con.close()


def test_ledger_list_shows_nights_used(tmp_path, capsys):
    from flows.cli import main

    url = f"sqlite:///{tmp_path / 'l.db'}"
    with Ledger(url) as lg:
        start(lg, "split-run")
        lg.record_night("split-run", night(1, 3.0, 10))
        lg.record_night("split-run", night(2, 4.5, 20))
        start(lg, "plain-run")
    assert main(["ledger", "--url", url, "list", "--json"]) == 0
    rows = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["split-run"]["nights"] == 2 and rows["plain-run"]["nights"] == 0
    assert rows["split-run"]["cost"] == pytest.approx(7.5)
    assert main(["ledger", "--url", url, "list"]) == 0
    out = capsys.readouterr().out
    assert "nights" in out and "2 (last 4.50 vs 5.00 ± 1.00)" in out
