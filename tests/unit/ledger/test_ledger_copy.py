"""`nightloom ledger copy`: a team's SQLite ledger, written by the first release and since used for runs and a night
queue, copied into an empty ledger on each backend (the `ledger_url` fixture: SQLite, then PostgreSQL) with every
table's every row (the refusals and the command once each, on one backend); a second copy copies nothing; a target with rows of its own is refused unless merged, one with
other values under the same keys always; the queue's next job id stays past every id the source handed out."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import JSON, Column, MetaData, String, Table, create_engine, select, text

from flows.cli import main as cli
from nightloom.gates import Verdict
from nightloom.ledger import Ledger, LedgerError
from nightloom.ledger import engine as ledger_mod
from nightloom.ledger import migrations as ledger_migrations
from nightloom.ledger.copy import MIGRATION_TABLES, CopyRefused, copy_ledger
from nightloom.ledger.records import Figure
from nightloom.queue.jobs import QueuedJob
from nightloom.queue.store import QueueRun, QueueStore
from nightloom.spec import ScheduleSpec

T0 = datetime(2026, 6, 1, 2, 0, tzinfo=UTC)
FIRST = {  # a finished run as the first release wrote it (naive UTC times, JSON columns)
    "run_id": "first",
    "spec_hash": "s1",
    "name": "tiny-demo",
    "model": "llama2-7b",
    "cluster": "c1",
    "provider": "slurm",
    "gpu_type": "h100-80gb",
    "world_size": 8,
    "layout": "TP2·PP2·FSDP2",
    "plan": {"tp": 2, "pp": 2, "dp_shard": 2, "mfu": 0.45},
    "predicted_mfu": 0.45,
    "measured_mfu": 0.41,
    "tokens_per_s": 1e5,
    "currency": "CNY",
    "verdicts": [{"name": "mfu_floor", "passed": True, "measured": 0.4, "threshold": 0.3, "reason": "ok"}],
    "status": "succeeded",
    "started_at": datetime(2026, 6, 1, 2, 0),
    "finished_at": datetime(2026, 6, 1, 3, 0),
    "interruptions": [{"at": "2026-06-01T02:05:00Z", "kind": "node_lost", "detail": "n3 gone", "recovery_s": 30.0}],
    "interruption_count": 1,
    "recovery_s": 30.0,
}


def first_release_ledger(db: Path) -> str:
    """A SQLite ledger as the first release left it (schema 1, no Alembic table), then used by this nightloom: a
    run with figures, a queue with three jobs (one removed again) and a night's run."""
    url = f"sqlite:///{db}"
    eng = create_engine(url)
    with eng.begin() as conn:
        command.upgrade(ledger_mod.alembic_config(conn), "0001")
        conn.execute(text(f"DROP TABLE {ledger_migrations.VERSION_TABLE}"))
        cols = [Column(k, JSON if k in ("plan", "verdicts", "interruptions") else None) for k in FIRST]
        conn.execute(Table("nightloom_runs", MetaData(), Column("run_id", String(128), primary_key=True), *cols[1:])
                     .insert(), [FIRST])  # fmt: skip
    eng.dispose()
    with Ledger(url) as lg:
        lg.start_run(run_id="new", spec_hash="s2", name="n", model="tiny", cluster="local", provider="local",
                     gpu_type="cpu", world_size=2, started_at=T0)  # fmt: skip
        lg.finish_run(
            "new",
            status="succeeded",
            tokens_per_s=5.0,
            verdicts=[Verdict(name="g", passed=True, reason="ok")],
            figures=[Figure(name="track/mlflow/3f2a", value=0.0)],
        )
        store = QueueStore(lg)
        store.create("team", 4, budget_per_night=100.0)
        jobs = [store.add("team", job(f"j{i}"), spec={"name": f"j{i}"}) for i in range(3)]
        store.remove("team", jobs[2].id)  # its id is never handed out again
        store.record_run(QueueRun(queue="team", job_id=jobs[0].id, night=T0, segment_start=T0, segment_end=T0,
                                  nodes=[0, 1], run_id="new", status="completed", job_status="done", steps_done=10,
                                  hours_trained=1.0, started_at=T0, finished_at=T0))  # fmt: skip
    return url


def job(name: str) -> QueuedJob:
    return QueuedJob(name=name, spec_hash="h", nodes=1, gpus=8, policy="split", steps=10, step_time_s=1.0,
                     hours_source="given", provisioning_s=0.0, checkpoint_s=0.0, restore_s=0.0,
                     schedule=ScheduleSpec())  # fmt: skip


def dump(url: str) -> dict[str, list[dict]]:
    """Every row of every ledger table, by primary key (the migrations' own tables left out)."""
    eng = create_engine(url)
    md = MetaData()
    md.reflect(eng)
    with eng.connect() as conn:
        out = {
            t.name: [dict(r._mapping) for r in conn.execute(select(t).order_by(*t.primary_key.columns))]
            for t in md.sorted_tables
            if t.name not in MIGRATION_TABLES
        }
    eng.dispose()
    return out


@pytest.fixture
def source(tmp_path: Path) -> str:
    return first_release_ledger(tmp_path / "team.db")


def test_every_row_of_every_table_is_copied_once_and_the_queue_goes_on(source: str, ledger_url: str):
    report = copy_ledger(source, ledger_url)
    before, after = dump(source), dump(ledger_url)
    counts = {"nightloom_runs": 2, "nightloom_queues": 1, "nightloom_queue_jobs": 2, "nightloom_queue_runs": 1}
    assert after == before and {t: len(rows) for t, rows in before.items()} == counts
    assert report.copied == 6 and {t.table: t.copied for t in report.tables}["nightloom_queue_jobs"] == 2
    assert copy_ledger(source, ledger_url).copied == 0 and dump(ledger_url) == before  # idempotent
    with Ledger(ledger_url) as lg:
        first = lg.get("first")
        assert (first.layout, first.measured_mfu, first.started_at, first.interruptions[0].detail) == (
            "TP2·PP2·FSDP2", 0.41, T0, "n3 gone")  # fmt: skip
        store = QueueStore(lg)
        assert [j.name for j in store.jobs("team")] == ["j0", "j1"]
        assert store.add("team", job("j3"), spec={}).id == 4  # past j2's id (3), removed in the source
        assert store.runs("team")[0].run_id == "new"
        store.remove("team", 4)
    back = f"sqlite:///{Path(source.removeprefix('sqlite:///')).parent / 'back.db'}"
    copy_ledger(ledger_url, back)  # and back again: the same rows, the same next id
    assert dump(back) == before
    with Ledger(back) as lg:
        assert QueueStore(lg).add("team", job("j5"), spec={}).id == 5


def test_a_target_with_rows_of_its_own_is_refused_unless_merged(source: str, pg_url: str):
    with Ledger(pg_url) as lg:
        lg.start_run(run_id="theirs", spec_hash="s", name="n", model="tiny", cluster="c", provider="local",
                     gpu_type="cpu", world_size=1, started_at=T0)  # fmt: skip
    with pytest.raises(CopyRefused, match=r"rows the source does not: nightloom_runs \(1\).*--merge.*nothing copied"):
        copy_ledger(source, pg_url)
    assert [r["run_id"] for r in dump(pg_url)["nightloom_runs"]] == ["theirs"]  # nothing half-copied
    report = copy_ledger(source, pg_url, merge=True)
    assert report.copied == 6 and {r["run_id"] for r in dump(pg_url)["nightloom_runs"]} == {
        "first",
        "new",
        "theirs",
    }


def test_other_values_under_the_same_key_are_refused_by_table_and_key(source: str, tmp_path: Path):
    ledger_url = f"sqlite:///{tmp_path / 'target.db'}"
    with Ledger(ledger_url) as lg:
        lg.start_run(run_id="new", spec_hash="other", name="n", model="tiny", cluster="c", provider="local",
                     gpu_type="cpu", world_size=1, started_at=T0)  # fmt: skip
    with pytest.raises(CopyRefused, match=r"other values for: nightloom_runs \['run_id'\]=\['new'\]"):
        copy_ledger(source, ledger_url, merge=True)
    assert [r["spec_hash"] for r in dump(ledger_url)["nightloom_runs"]] == ["other"]


def test_the_command_copies_and_says_what_without_the_password(source: str, pg_url: str, capsys):
    assert cli(["ledger", "--url", source, "copy", "--to", pg_url]) == 0
    out = capsys.readouterr().out
    assert "nightloom_queue_jobs: 2 rows, 2 copied, 0 already there" in out and "6 rows copied" in out
    password = create_engine(pg_url).url.password
    assert not password or password not in out
    assert cli(["ledger", "--url", source, "copy", "--to", pg_url]) == 0
    assert "0 rows copied" in capsys.readouterr().out


def test_a_missing_source_or_a_longer_value_than_the_target_takes_is_refused(tmp_path: Path, pg_url: str):
    with pytest.raises(LedgerError, match="no ledger at sqlite:///.*nope.db: the file does not exist"):
        copy_ledger(f"sqlite:///{tmp_path / 'nope.db'}", pg_url)
    src = first_release_ledger(tmp_path / "long.db")
    eng = create_engine(src)
    with eng.begin() as conn:  # SQLite keeps what its column's width would refuse
        conn.execute(text("UPDATE nightloom_runs SET currency = 'TOOLONGCURRENCY' WHERE run_id = 'new'"))
    eng.dispose()
    with pytest.raises(CopyRefused, match=r"nightloom_runs \['run_id'\]=\['new'\]: currency holds 15 characters"):
        copy_ledger(src, pg_url)
    assert all(rows == [] for rows in dump(pg_url).values())  # refused before anything was written
