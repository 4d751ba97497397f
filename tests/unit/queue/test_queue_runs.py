"""What the nightly-queue deployment ran, kept in the ledger (schema 4): a ledger written at schema 3 (with a queue
and a job) opens with nothing lost and gains the runs table; a night's record sets the job's status, and the
progress and the plan's jobs follow from what ran (a split job continues with the steps it has left, a failed
night is planned again, a finished job leaves the plan)."""

from __future__ import annotations

import io
import sqlite3
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine

from nightloom.ledger import SCHEMA_VERSION, Ledger
from nightloom.ledger import engine as ledger_mod
from nightloom.ledger import migrations as ledger_migrations
from nightloom.queue.jobs import QueuedJob
from nightloom.queue.store import QueueRun, QueueStore
from nightloom.spec import ScheduleSpec

T0 = datetime(2026, 6, 1, 2, 0, tzinfo=UTC)
SCHED = ScheduleSpec(policy="split", timezone="Asia/Shanghai", price_per_gpu_hour=2.5)


def figures(name: str) -> QueuedJob:
    return QueuedJob(
        name=name,
        spec_hash="h" + name,
        nodes=1,
        gpus=8,
        policy="split",
        steps=100,
        step_time_s=72.0,
        hours_source="given",
        provisioning_s=600.0,
        checkpoint_s=40.0,
        restore_s=40.0,
        schedule=SCHED,
    )


def sql(db: Path, statement: str) -> list[tuple]:
    with closing(sqlite3.connect(db)) as con, con:
        return con.execute(statement).fetchall()


def night(job_id: int, status: str, job_status: str, steps: int, run_id: str | None, day: int = 0) -> QueueRun:
    t = T0 + timedelta(days=day)
    return QueueRun(
        queue="team",
        job_id=job_id,
        night=t,
        segment_start=t,
        segment_end=t + timedelta(hours=4),
        nodes=[0],
        run_id=run_id,
        flow_run_id="fr",
        status=status,
        job_status=job_status,
        steps_done=steps,
        hours_trained=1.5,
        reason="r",
        started_at=t,
        finished_at=t + timedelta(hours=4),
    )


def test_a_schema_3_ledger_opens_with_its_queue_and_gains_the_runs_table(tmp_path: Path):
    db = tmp_path / "v3.db"
    url = f"sqlite:///{db}"
    eng = create_engine(url)
    with eng.begin() as conn:
        command.upgrade(ledger_mod.alembic_config(conn), "0003")
    eng.dispose()
    # a queue as a schema-3 nightloom wrote it
    sql(db, "INSERT INTO nightloom_queues VALUES ('team', 2, NULL, NULL, '2026-06-01 02:00:00.000000')")
    before = sql(db, "SELECT * FROM nightloom_queues")
    assert sql(db, "SELECT version FROM nightloom_schema") == [(3,)]
    assert not sql(db, "SELECT name FROM sqlite_master WHERE name = 'nightloom_queue_runs'")

    with Ledger(url) as lg:
        assert lg.schema_version() == SCHEMA_VERSION == 7
        store = QueueStore(lg)
        assert store.get("team").max_nodes == 2 and store.runs("team") == []
        job = store.add("team", figures("a"), spec={"name": "a"}, added_at=T0)
        rec = store.record_run(night(job.id, "split", "split", 40, "run-a"))
        assert rec.id is not None and store.runs("team") == [rec]
    assert sql(db, "SELECT * FROM nightloom_queues")[0][:3] == before[0][:3]  # its schedule is the job's now
    assert sql(db, f"SELECT version_num FROM {ledger_migrations.VERSION_TABLE}") == [("0007",)]
    assert sql(db, "SELECT version FROM nightloom_schema") == [(7,)]


def test_nights_set_the_job_status_and_the_plan_continues_from_them(ledger_url: str):
    with Ledger(ledger_url) as lg:
        store = QueueStore(lg)
        store.create("team", 2)
        a = store.add("team", figures("a"), spec={"name": "a"}, added_at=T0)
        b = store.add("team", figures("b"), spec={"name": "b"}, added_at=T0)
        assert [j.steps for j in store.plan_jobs("team")] == [100, 100]
        store.record_run(night(a.id, "split", "split", 40, "run-a"))
        store.record_run(night(b.id, "failed", "queued", 0, None))
        prog = store.progress("team")
        assert (prog[a.id].steps_done, prog[a.id].run_id, prog[a.id].status) == (40, "run-a", "split")
        assert (prog[b.id].steps_done, prog[b.id].status, prog[b.id].nights) == (0, "queued", 1)
        assert [j.status for j in store.jobs("team")] == ["split", "queued"]
        left = {j.id: j for j in store.plan_jobs("team")}
        assert left[a.id].steps == 60 and left[a.id].provisioning_s == 640.0  # restore on top
        assert left[b.id].steps == 100 and left[b.id].provisioning_s == 600.0  # failed at once: planned again
        store.record_run(night(a.id, "completed", "done", 100, "run-a", day=1))
        assert [j.id for j in store.plan_jobs("team")] == [b.id]
        assert [r.job_id for r in store.runs("team", a.id)] == [a.id, a.id]
        assert store.progress("team")[a.id].nights == 2


def test_the_runs_table_renders_for_postgresql():
    out = io.StringIO()
    cfg = Config(output_buffer=out)
    cfg.set_main_option("script_location", str(ledger_migrations.SCRIPT_DIR))
    cfg.set_main_option("sqlalchemy.url", "postgresql://ledger@db/nightloom")
    command.upgrade(cfg, "0003:0004", sql=True)
    text = out.getvalue()
    assert (
        "CREATE TABLE nightloom_queue_runs" in text and "UPDATE nightloom_schema SET version = 4 WHERE id = 1" in text
    )
