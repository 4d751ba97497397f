"""The night queues in the ledger (schema 3): a ledger written at schema 2 opens with nothing lost and its queue
tables usable; queues and jobs round-trip typed; a refused job leaves the queue exactly as it was."""

from __future__ import annotations

import io
import sqlite3
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

from nightloom.ledger import SCHEMA_VERSION, Ledger, NightRecord
from nightloom.ledger import engine as ledger_mod
from nightloom.ledger import migrations as ledger_migrations
from nightloom.queue.jobs import QueuedJob, QueueRefused
from nightloom.queue.store import QueueError, QueueStore, queue_metadata
from nightloom.spec import ScheduleSpec

T0 = datetime(2026, 6, 1, 2, 0, tzinfo=UTC)
SCHED = ScheduleSpec(policy="split", timezone="Asia/Shanghai", price_per_gpu_hour=2.5)


def figures(name="j", nodes=2, policy="split", schedule=SCHED, hours=2.0) -> QueuedJob:
    return QueuedJob(
        name=name,
        spec_hash="h" + name,
        nodes=nodes,
        gpus=8 * nodes,
        policy=policy,
        steps=100,
        step_time_s=hours * 36.0,
        hours_source=f"given: {hours:g} h for 100 steps",
        provisioning_s=600.0,
        checkpoint_s=40.0,
        restore_s=40.0,
        schedule=schedule.model_copy(update={"policy": policy}),
    )


def add(store: QueueStore, queue: str, fig: QueuedJob, **kw):
    return store.add(queue, fig, spec={"name": fig.name}, **kw)


def sql(db: Path, statement: str, *params) -> list[tuple]:
    with closing(sqlite3.connect(db)) as con, con:
        return con.execute(statement, params).fetchall()


def write_schema_2_ledger(db: Path) -> str:
    """A ledger as nightloom wrote it at schema 2 (Alembic head 0002), with a finished run that has a night."""
    url = f"sqlite:///{db}"
    eng = create_engine(url)
    with eng.begin() as conn:
        command.upgrade(ledger_mod.alembic_config(conn), "0002")
    eng.dispose()
    night = '[{"night": 1, "start": "2026-06-01T02:00:00Z", "end": "2026-06-01T06:00:00Z", "steps": 10, '
    night += '"steps_done": 10, "cost": 3.0, "stopped": "window"}]'
    cols = "run_id, spec_hash, name, model, cluster, provider, gpu_type, world_size, currency, verdicts, status, "
    cols += "started_at, finished_at, interruptions, interruption_count, recovery_s, cost, tokens_per_s, nights"
    row = ("old", "s1", "n", "llama2-7b", "c1", "slurm", "h100-80gb", 16, "USD", "[]", "stopped")
    row += ("2026-06-01 02:00:00.000000", "2026-06-01 06:00:00.000000", "[]", 0, 0.0, 3.0, 1e5, night)
    sql(db, f"INSERT INTO nightloom_runs ({cols}) VALUES ({', '.join('?' * len(row))})", *row)
    return url


def test_a_schema_2_ledger_opens_with_nothing_lost_and_gains_usable_queue_tables(tmp_path: Path):
    db = tmp_path / "v2.db"
    url = write_schema_2_ledger(db)
    assert not sql(db, "SELECT name FROM sqlite_master WHERE name LIKE 'nightloom_queue%'")
    before = sql(db, "SELECT * FROM nightloom_runs")

    with Ledger(url) as lg:
        assert lg.schema_version() == SCHEMA_VERSION == 7
        old = lg.get("old")
        assert (old.status, old.cost, old.tokens_per_s, old.world_size) == ("stopped", 3.0, 1e5, 16)
        assert old.started_at == T0 and old.finished_at == T0 + timedelta(hours=4)
        assert [(n.night, n.steps_done, n.cost, n.stopped) for n in old.nights] == [(1, 10, 3.0, "window")]
        # every row and field as it was (schema 5 adds its preemption counters at the end)
        assert [r[: len(before[0])] for r in sql(db, "SELECT * FROM nightloom_runs")] == before
        assert (
            lg.record_night("old", NightRecord(night=2, start=T0, end=T0, steps=1, steps_done=11, cost=1.0)).cost == 4.0
        )
        store = QueueStore(lg)
        q = store.create("team", 4, 500.0, created_at=T0)
        assert (q.name, q.max_nodes, q.budget_per_night, q.schedule, q.created_at) == ("team", 4, 500.0, None, T0)
        job = add(store, "team", figures(), priority=2, deadline=T0 + timedelta(days=2), added_at=T0)
        assert store.jobs("team") == [job]

    assert sql(db, f"SELECT version_num FROM {ledger_migrations.VERSION_TABLE}") == [("0007",)]
    assert sql(db, "SELECT version FROM nightloom_schema") == [(7,)]  # an older nightloom refuses it
    with Ledger(url) as lg:  # and opens again, the queue kept
        assert [j.id for j in QueueStore(lg).jobs("team")] == [job.id]


def test_a_new_ledger_matches_the_queue_tables_and_downgrades_past_them(tmp_path: Path):
    db = tmp_path / "new.db"
    url = f"sqlite:///{db}"
    with Ledger(url) as lg:
        with lg.engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": ledger_migrations.VERSION_TABLE})
            assert compare_metadata(ctx, [ledger_mod.Base.metadata, queue_metadata]) == []
        QueueStore(lg).create("q", 2)
        add(QueueStore(lg), "q", figures())
    eng = create_engine(url)
    with eng.begin() as conn:
        command.downgrade(ledger_mod.alembic_config(conn), "0002")
    eng.dispose()
    assert not sql(db, "SELECT name FROM sqlite_master WHERE name LIKE 'nightloom_queue%'")
    assert sql(db, "SELECT version FROM nightloom_schema") == [(2,)]
    with Ledger(url) as lg:  # upgraded again: empty queue tables
        assert lg.schema_version() == SCHEMA_VERSION and QueueStore(lg).names() == []


def test_the_queue_tables_render_for_postgresql():
    out = io.StringIO()
    cfg = Config(output_buffer=out)
    cfg.set_main_option("script_location", str(ledger_migrations.SCRIPT_DIR))
    cfg.set_main_option("sqlalchemy.url", "postgresql://ledger@db/nightloom")
    command.upgrade(cfg, "0002:0003", sql=True)
    text = out.getvalue()
    assert "CREATE TABLE nightloom_queues" in text and "CREATE TABLE nightloom_queue_jobs" in text
    assert "id SERIAL NOT NULL" in text and "FOREIGN KEY(queue) REFERENCES nightloom_queues (name)" in text
    assert "UPDATE nightloom_schema SET version = 3 WHERE id = 1" in text


@pytest.fixture
def store(ledger_url: str):  # once on SQLite, once on PostgreSQL (tests/support/postgres.py)
    with Ledger(ledger_url) as lg:
        yield QueueStore(lg)


def test_queues_and_jobs_round_trip_typed(store: QueueStore):
    store.create("team", 4)
    with pytest.raises(QueueError, match="queue 'team' is already in the ledger"):
        store.create("team", 8)
    with pytest.raises(QueueError, match="--max-nodes must be >= 1"):
        store.create("zero", 0)
    a = add(store, "team", figures("a"), priority=1, added_at=T0)
    b = add(store, "team", figures("b", policy="wait"), priority=3, deadline=T0 + timedelta(hours=5), added_at=T0)
    assert store.get("team").schedule == SCHED.model_copy(update={"policy": "split"})  # the first job's
    assert [j.name for j in store.jobs("team")] == ["a", "b"] and b.id > a.id
    got = store.jobs("team")[1]
    assert got == b and got.deadline == T0 + timedelta(hours=5) and got.hours == pytest.approx(2.0)
    assert store.plan_jobs("team") == store.jobs("team")  # no night ran yet: the plan packs the stored records
    price = got.schedule.price_per_gpu_hour
    assert (got.id, got.priority, got.nodes, got.gpus, got.policy, price) == (b.id, 3, 2, 16, "wait", 2.5)
    assert store.names() == ["team"]
    with pytest.raises(QueueError, match="no queue 'nope'"):
        store.jobs("nope")


def test_a_refused_job_leaves_the_queue_unchanged(store: QueueStore):
    store.create("team", 4)
    add(store, "team", figures("a"))
    before = (store.get("team"), store.jobs("team"))
    other_zone = SCHED.model_copy(update={"timezone": "Europe/Berlin"})
    other_windows = ScheduleSpec.model_validate(SCHED.model_dump() | {"windows": [{"start": "01:00", "end": "05:00"}]})
    cases = {
        "cluster.nodes: the job needs 8 nodes; the queue has 4": figures("wide", nodes=8),
        "schedule.timezone: 'Europe/Berlin' contradicts the queue's 'Asia/Shanghai'": figures(
            "tz", schedule=other_zone
        ),
        "schedule.windows: 01:00–05:00 contradict the queue's 02:00–06:00": figures("w", schedule=other_windows),
        "schedule.policy: 'run-now': a queue runs its jobs inside its windows": figures("now", policy="run-now"),
    }
    for reason, fig in cases.items():
        with pytest.raises(QueueRefused, match=f"queue 'team' refuses {fig.name}: .*{reason}"):
            add(store, "team", fig)
        assert (store.get("team"), store.jobs("team")) == before
    with pytest.raises(QueueRefused, match="--priority must be >= 1"):
        add(store, "team", figures("p"), priority=0)
    assert (store.get("team"), store.jobs("team")) == before


def test_remove_frees_the_id_for_nothing_and_the_last_job_out_clears_the_schedule(store: QueueStore):
    store.create("team", 4)
    a = add(store, "team", figures("a"))
    b = add(store, "team", figures("b"))
    assert store.remove("team", b.id) == b
    with pytest.raises(QueueError, match=f"no job {b.id} in queue 'team'"):
        store.remove("team", b.id)
    c = add(store, "team", figures("c"))
    assert c.id > b.id  # never reused
    store.remove("team", a.id)
    assert store.get("team").schedule is not None
    store.remove("team", c.id)
    assert store.get("team").schedule is None and store.jobs("team") == []
    berlin = SCHED.model_copy(update={"timezone": "Europe/Berlin"})
    assert add(store, "team", figures("d", schedule=berlin)).schedule.timezone == "Europe/Berlin"


def test_a_queue_table_has_a_column_per_record_field_typed_by_the_field():
    """The tables are derived from their records (nightloom/queue/store.py): a new text field without a column
    length is refused by name at import, not stored unbounded."""
    from nightloom.queue import store
    from nightloom.records import Record

    for table, record in (
        (store._Queue, store.QueueRecord),
        (store._Job, store.QueuedJob),
        (store._Run, store.QueueRun),
    ):
        assert [c.name for c in table.__table__.columns if c.name not in ("id", "queue")] == [
            n for n in record.model_fields if n not in ("id", "queue")
        ]
    assert store._Job.__table__.c.added_at.nullable is False  # filled by the store, though None in a new job
    assert store._Job.__table__.c.deadline.nullable is True

    class Planted(Record):
        note: str

    with pytest.raises(TypeError, match=r"Planted.note is text: give its column's length"):
        store._column(Planted, "note")
