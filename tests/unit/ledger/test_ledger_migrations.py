"""The ledger's Alembic migrations: ledgers written before Alembic (schema 1 and 2) open with nothing lost, a new
ledger is at head and matches the ORM tables, newer ledgers are refused, and the SQL renders for PostgreSQL."""

from __future__ import annotations

import io
import json
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

from nightloom.ledger import SCHEMA_VERSION, Ledger, LedgerError, NightRecord
from nightloom.ledger import engine as ledger_mod
from nightloom.ledger import migrations as ledger_migrations
from nightloom.parallel import ParallelPlan
from nightloom.queue.store import queue_metadata

T0 = datetime(2026, 6, 1, 2, 0, tzinfo=UTC)

# What nightloom created before Alembic (SQLAlchemy's create_all on SQLite, copied from such a ledger).
SCHEMA_1_DDL = """
CREATE TABLE nightloom_schema (
    id INTEGER NOT NULL,
    version INTEGER NOT NULL,
    PRIMARY KEY (id)
);
CREATE TABLE nightloom_runs (
    run_id VARCHAR(128) NOT NULL, spec_hash VARCHAR(64) NOT NULL, name VARCHAR(128) NOT NULL,
    model VARCHAR(128) NOT NULL, cluster VARCHAR(128) NOT NULL, provider VARCHAR(32) NOT NULL,
    gpu_type VARCHAR(64) NOT NULL, world_size INTEGER NOT NULL, layout VARCHAR(128), "plan" JSON,
    predicted_mfu FLOAT, measured_mfu FLOAT, hfu FLOAT, tokens_per_s FLOAT, final_loss FLOAT,
    time_to_ready_s FLOAT, duration_s FLOAT, cost FLOAT, currency VARCHAR(8) NOT NULL, precision VARCHAR(16),
    peak_source VARCHAR(512), verdicts JSON NOT NULL, status VARCHAR(16) NOT NULL, reason VARCHAR(2048),
    started_at DATETIME NOT NULL, finished_at DATETIME, interruptions JSON NOT NULL,
    interruption_count INTEGER NOT NULL, recovery_s FLOAT NOT NULL, metrics_path VARCHAR(1024),
    {extra}PRIMARY KEY (run_id)
);
CREATE INDEX ix_nightloom_runs_gpu_type ON nightloom_runs (gpu_type);
CREATE INDEX ix_nightloom_runs_spec_hash ON nightloom_runs (spec_hash);
CREATE INDEX ix_nightloom_runs_cluster ON nightloom_runs (cluster);
CREATE INDEX ix_nightloom_runs_status ON nightloom_runs (status);
CREATE INDEX ix_nightloom_runs_model ON nightloom_runs (model);
"""

PLAN = {"tp": 2, "pp": 2, "dp_shard": 2, "mfu": 0.45}
VERDICTS = [
    {"name": "mfu_floor", "passed": True, "measured": 0.4, "threshold": 0.3, "reason": "ok", "skipped": False},
    {"name": "loss_drop", "passed": True, "measured": 0.3, "threshold": 0.05, "reason": "ok", "skipped": False},
]
INTERRUPTIONS = [
    {"at": "2026-06-01T02:05:00Z", "kind": "node_lost", "detail": "n3 gone", "recovery_s": 30.0},
    {"at": "2026-06-01T02:40:00Z", "kind": "preempted", "detail": "", "recovery_s": 12.5, "lost_s": 90.0},
]
DONE = {  # a finished run with every JSON column filled
    "run_id": "done",
    "spec_hash": "s1",
    "name": "tiny-demo",
    "model": "llama2-7b",
    "cluster": "c1",
    "provider": "slurm",
    "gpu_type": "h100-80gb",
    "world_size": 8,
    "layout": "TP2·PP2·FSDP2",
    "plan": json.dumps(PLAN),
    "predicted_mfu": 0.45,
    "measured_mfu": 0.41,
    "hfu": 0.5,
    "tokens_per_s": 1e5,
    "final_loss": 2.1,
    "time_to_ready_s": 42.0,
    "duration_s": 3600.0,
    "cost": 12.5,
    "currency": "CNY",
    "precision": "bf16",
    "peak_source": "datasheet: H100",
    "verdicts": json.dumps(VERDICTS),
    "status": "succeeded",
    "reason": None,
    "started_at": "2026-06-01 02:00:00.000000",
    "finished_at": "2026-06-01 03:00:00.000000",
    "interruptions": json.dumps(INTERRUPTIONS),
    "interruption_count": 2,
    "recovery_s": 42.5,
    "metrics_path": "/runs/done/metrics.jsonl",
}
RUNNING = {  # a run still open: every nullable field NULL
    **{k: None for k in DONE},
    "run_id": "running",
    "spec_hash": "s2",
    "name": "n",
    "model": "tiny",
    "cluster": "local",
    "provider": "local",
    "gpu_type": "cpu",
    "world_size": 2,
    "currency": "USD",
    "verdicts": "[]",
    "status": "running",
    "started_at": "2026-06-02 02:00:00.000000",
    "interruptions": "[]",
    "interruption_count": 0,
    "recovery_s": 0.0,
}


def write_old_ledger(db: Path, version: int, rows: list[dict]) -> str:
    """A ledger as nightloom wrote it before Alembic at schema `version` (1 or 2), with `rows`."""
    with closing(sqlite3.connect(db)) as con, con:
        con.executescript(SCHEMA_1_DDL.format(extra="nights JSON, " if version >= 2 else ""))
        con.execute("INSERT INTO nightloom_schema (id, version) VALUES (1, ?)", (version,))
        for row in rows:
            cols = ", ".join(f'"{c}"' for c in row)
            con.execute(f"INSERT INTO nightloom_runs ({cols}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
    return f"sqlite:///{db}"


def sql(db: Path, statement: str, *params) -> list[tuple]:
    """Run one statement on the SQLite file directly (committed, connection closed) and return its rows."""
    with closing(sqlite3.connect(db)) as con, con:
        return con.execute(statement, params).fetchall()


def columns(db: Path) -> list[str]:
    return [r[1] for r in sql(db, "PRAGMA table_info(nightloom_runs)")]


def markers(db: Path) -> tuple[list[str], int]:
    """(Alembic revisions, legacy integer version) stored in the ledger."""
    revs = [r[0] for r in sql(db, f"SELECT version_num FROM {ledger_migrations.VERSION_TABLE}")]
    ((legacy,),) = sql(db, "SELECT version FROM nightloom_schema WHERE id = 1")
    return revs, legacy


def assert_done_intact(lg: Ledger) -> None:
    rec = lg.get("done")
    assert rec.plan == ParallelPlan.model_validate(PLAN) and rec.layout == "TP2·PP2·FSDP2"
    assert [v.model_dump(mode="json", exclude_none=True) for v in rec.verdicts] == VERDICTS
    assert [(i.kind, i.detail, i.recovery_s, i.lost_s) for i in rec.interruptions] == [
        ("node_lost", "n3 gone", 30.0, None),
        ("preempted", "", 12.5, 90.0),
    ]
    assert rec.interruptions[0].at == T0 + timedelta(minutes=5)
    assert rec.started_at == T0 and rec.finished_at == T0 + timedelta(hours=1)
    scalars = {k: v for k, v in DONE.items() if k not in ("plan", "verdicts", "interruptions")}
    scalars |= {"started_at": T0, "finished_at": T0 + timedelta(hours=1)}
    assert rec.model_dump(include=set(scalars)) == scalars
    assert rec.verified


def test_a_schema_1_ledger_opens_with_every_row_and_field_and_gains_nights(tmp_path: Path):
    db = tmp_path / "v1.db"
    url = write_old_ledger(db, 1, [DONE, RUNNING])
    assert "nights" not in columns(db)

    with Ledger(url) as lg:
        assert lg.schema_version() == SCHEMA_VERSION == 7
        assert sorted(r.run_id for r in lg.list_runs()) == ["done", "running"]
        assert_done_intact(lg)
        running = lg.get("running")
        assert running.status == "running" and running.plan is None and running.verdicts == []
        assert running.started_at == T0 + timedelta(days=1) and running.nights == [] and running.cost is None
        assert lg.get("done").nights == []
        night = NightRecord(night=1, start=T0, end=T0 + timedelta(hours=4), steps=10, steps_done=10, cost=3.0)
        assert lg.record_night("running", night).nights == [night]

    assert "nights" in columns(db)
    assert markers(db) == (["0007"], 7)  # the legacy row moves too, so an older nightloom refuses this ledger
    runs_index = (
        "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL AND tbl_name = 'nightloom_runs'"
    )
    indexes = {r[0] for r in sql(db, runs_index)}
    assert indexes == {f"ix_nightloom_runs_{c}" for c in ("gpu_type", "spec_hash", "cluster", "status", "model")}


def test_a_schema_2_ledger_without_alembic_is_stamped_at_2_not_migrated_from_1(tmp_path: Path, monkeypatch):
    db = tmp_path / "v2.db"
    nights = [{"night": 1, "start": "2026-06-01T18:00:00Z", "end": "2026-06-01T22:00:00Z", "steps": 10}]
    nights[0] |= {"steps_done": 10, "cost": 3.0, "stopped": "window", "predicted_cost": 3.5}
    url = write_old_ledger(db, 2, [DONE | {"nights": json.dumps(nights)}, RUNNING])
    stamped, upgraded_from = [], []
    real_stamp, real_upgrade = ledger_mod.command.stamp, ledger_mod.command.upgrade

    def stamp(cfg, rev, *a, **k):
        stamped.append(rev)
        return real_stamp(cfg, rev, *a, **k)

    def upgrade(cfg, rev, *a, **k):  # only the revisions after schema 2 run (the queue tables)
        upgraded_from.append(ledger_mod.current_revisions(cfg.attributes["connection"]))
        return real_upgrade(cfg, rev, *a, **k)

    monkeypatch.setattr(ledger_mod.command, "stamp", stamp)
    monkeypatch.setattr(ledger_mod.command, "upgrade", upgrade)
    with Ledger(url) as lg:
        assert stamped == ["0002"] and upgraded_from == [("0002",)]
        assert lg.schema_version() == SCHEMA_VERSION
        assert_done_intact(lg)
        (n,) = lg.get("done").nights
        assert (n.night, n.steps_done, n.cost, n.stopped, n.predicted_cost) == (1, 10, 3.0, "window", 3.5)
        assert n.end == datetime(2026, 6, 1, 22, 0, tzinfo=UTC)
    assert markers(db) == (["0007"], 7)
    monkeypatch.undo()
    with Ledger(url) as lg:  # and opens again as an Alembic ledger
        assert lg.schema_version() == SCHEMA_VERSION and len(lg.list_runs()) == 2


def test_a_new_ledger_is_at_head_and_its_tables_match_the_models(tmp_path: Path):
    db = tmp_path / "new.db"
    url = f"sqlite:///{db}"
    with Ledger(url) as lg:
        assert lg.schema_version() == SCHEMA_VERSION
        assert ledger_mod.migration_scripts().get_current_head() == f"{SCHEMA_VERSION:04d}"
        with lg.engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": ledger_migrations.VERSION_TABLE})
            tables = [ledger_mod.Base.metadata, queue_metadata]
            assert compare_metadata(ctx, tables) == []  # migrations and ORM agree
    assert markers(db) == ([f"{SCHEMA_VERSION:04d}"], SCHEMA_VERSION)


def test_downgrade_to_schema_1_and_back_keeps_the_rows(tmp_path: Path):
    db = tmp_path / "l.db"
    url = write_old_ledger(db, 1, [DONE, RUNNING])
    Ledger(url).close()
    eng = create_engine(url)
    with eng.begin() as conn:
        command.downgrade(ledger_mod.alembic_config(conn), "0001")
    eng.dispose()
    assert "nights" not in columns(db) and markers(db) == (["0001"], 1)
    with Ledger(url) as lg:
        assert lg.schema_version() == SCHEMA_VERSION and len(lg.list_runs()) == 2
        assert_done_intact(lg)


@pytest.mark.parametrize("rev", ["0099", "9f3c2a1b7d04"])
def test_an_unknown_revision_is_refused_naming_ledger_and_revision(tmp_path: Path, rev: str):
    db = tmp_path / "future.db"
    url = f"sqlite:///{db}"
    Ledger(url).close()
    sql(db, f"UPDATE {ledger_migrations.VERSION_TABLE} SET version_num = ?", rev)
    with pytest.raises(LedgerError, match=rf"ledger sqlite:///{db} is at schema revision '{rev}'.*upgrade nightloom"):
        Ledger(url)
    assert markers(db)[0] == [rev]  # left as it was


def test_a_pre_alembic_ledger_newer_than_this_code_is_refused(tmp_path: Path):
    db = tmp_path / "v9.db"
    url = write_old_ledger(db, 1, [RUNNING])
    sql(db, "UPDATE nightloom_schema SET version = 9")
    with pytest.raises(LedgerError, match=rf"{db} has schema version 9; .* up to {SCHEMA_VERSION}: upgrade nightloom"):
        Ledger(url)
    assert not sql(db, "SELECT 1 FROM sqlite_master WHERE name = ?", ledger_migrations.VERSION_TABLE)


def test_a_runs_table_without_any_version_is_refused(tmp_path: Path):
    db = tmp_path / "odd.db"
    sql(db, "CREATE TABLE nightloom_runs (run_id VARCHAR(128) PRIMARY KEY)")
    with pytest.raises(LedgerError, match=rf"{db} has a nightloom_runs table but no schema version"):
        Ledger(f"sqlite:///{db}")


def test_the_migrations_render_for_postgresql():
    """Offline (`alembic upgrade --sql`): the DDL a PostgreSQL ledger gets, without a server."""
    out = io.StringIO()
    cfg = Config(output_buffer=out)
    cfg.set_main_option("script_location", str(ledger_migrations.SCRIPT_DIR))
    cfg.set_main_option("sqlalchemy.url", "postgresql://ledger@db/nightloom")
    command.upgrade(cfg, "head", sql=True)
    sql = out.getvalue()
    assert "CREATE TABLE nightloom_runs" in sql and "started_at TIMESTAMP WITHOUT TIME ZONE NOT NULL" in sql
    assert "ALTER TABLE nightloom_runs ADD COLUMN nights JSON" in sql
    assert "UPDATE nightloom_schema SET version = 2 WHERE id = 1" in sql
    assert f"CREATE TABLE {ledger_migrations.VERSION_TABLE}" in sql
    assert sql.index("CREATE TABLE nightloom_runs") < sql.index("ADD COLUMN nights")


def write_job(run_dir: Path, shape, hf_config: str | None, weights: str | None) -> None:
    """The job file the pipeline leaves in a run folder (tasks/train.write_job), for the model `shape`."""
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    job = TrainJob(
        run_id=run_dir.name, run_dir=str(run_dir), model=shape, plan=ParallelPlan(), train=TrainSpec(),
        manifest="shards", hf_config=hf_config, weights=weights,
    )  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job-attempt0.json").write_text(job.model_dump_json(indent=2))


def test_a_schema_5_ledger_gets_the_model_its_run_folder_trained_and_loses_nothing(tmp_path: Path):
    """Rows written before schema 6 say `tiny` for a Hugging Face run: where the run folder's job file is left,
    the migration names the model it trained (and its family); rows whose folder is gone keep what they said."""
    from nightloom.catalog import get_model
    from nightloom.hf.config import shape_from_hf_config

    db, runs = tmp_path / "v5.db", tmp_path / "runs"
    url = f"sqlite:///{db}"
    eng = create_engine(url)
    with eng.begin() as conn:  # the ledger as the previous nightloom built it
        command.upgrade(ledger_mod.alembic_config(conn), "0005")
    eng.dispose()
    qwen2 = Path(__file__).resolve().parents[3] / "deployments" / "chat-sft-demo-model.json"
    write_job(runs / "chat", shape_from_hf_config(qwen2), str(qwen2), str(tmp_path / "models" / "chat-sft-demo-qwen2"))
    write_job(runs / "cat", get_model("tiny-tied"), None, None)
    (runs / "broken").mkdir()
    (runs / "broken" / "job-attempt0.json").write_text("{not json")
    chat = DONE | {"run_id": "chat", "model": "tiny", "metrics_path": str(runs / "chat" / "metrics.jsonl")}
    cat = RUNNING | {"run_id": "cat", "model": "tiny-tied", "metrics_path": str(runs / "cat" / "metrics.jsonl")}
    gone = RUNNING | {"run_id": "gone", "metrics_path": str(runs / "gone" / "metrics.jsonl")}  # folder deleted
    broken = RUNNING | {"run_id": "broken", "metrics_path": str(runs / "broken" / "metrics.jsonl")}
    rows = [DONE, RUNNING, chat, cat, gone, broken]
    with closing(sqlite3.connect(db)) as con, con:
        for row in rows:
            cols = ", ".join(f'"{c}"' for c in row)
            con.execute(f"INSERT INTO nightloom_runs ({cols}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
    before = {r[0]: r for r in sql(db, "SELECT * FROM nightloom_runs ORDER BY run_id")}
    model_at = columns(db).index("model")

    with Ledger(url) as lg:
        assert lg.schema_version() == SCHEMA_VERSION == 7
        got = {r.run_id: (r.model, r.family) for r in lg.list_runs()}
        assert got == {
            "chat": ("chat-sft-demo-qwen2", "qwen2"),  # corrected from its job file
            "cat": ("tiny-tied", "tiny"),  # a catalog run: the job file agrees
            "done": ("llama2-7b", "llama2"),  # folder gone: left as it was, family of its name
            "running": ("tiny", "tiny"),  # no run folder recorded
            "gone": ("tiny", "tiny"),
            "broken": ("tiny", "tiny"),  # an unreadable job file does not fail the migration
        }
        assert_done_intact(lg)
        assert lg.best("chat-sft-demo-qwen2", "c1").run_id == "chat" and lg.best("tiny", "c1") is None
        assert lg.calibration("h100-80gb", "qwen2").runs == 1 and lg.calibration("h100-80gb", "tiny") is None

    after = {r[0]: r for r in sql(db, "SELECT * FROM nightloom_runs ORDER BY run_id")}
    assert markers(db) == (["0007"], 7) and columns(db)[-3:] == ["family", "task", "figures"]
    for run_id, old in before.items():  # every other field of every row as it was
        new = list(after[run_id][: len(old)])
        if run_id == "chat":
            assert new[model_at] == "chat-sft-demo-qwen2"
            new[model_at] = "tiny"
        assert tuple(new) == old

    eng = create_engine(url)
    with eng.begin() as conn:  # and down again: the family goes, the corrected name stays
        command.downgrade(ledger_mod.alembic_config(conn), "0005")
    eng.dispose()
    assert "family" not in columns(db) and sql(db, "SELECT model FROM nightloom_runs WHERE run_id = 'chat'") == [
        ("chat-sft-demo-qwen2",)
    ]
