"""The ledger on PostgreSQL (a team's shared ledger): a first-release ledger migrated there keeps every row, every
revision's SQL runs there both ways, 8 writers x 50 runs at once lose nothing (ledger rows and queue changes), a
serialization failure is run again; and a SQLite ledger on a network filesystem is recognised."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import JSON, Column, MetaData, String, Table, create_engine, select, text

from nightloom.ledger import SCHEMA_VERSION, Ledger
from nightloom.ledger import engine as ledger_mod
from nightloom.ledger import migrations as ledger_migrations
from nightloom.parallel import ParallelPlan
from nightloom.queue.store import QueueStore, queue_metadata

ROOT = Path(__file__).resolve().parents[3]
T0 = datetime(2026, 6, 1, 2, 0, tzinfo=UTC)
PLAN = {"tp": 2, "pp": 2, "dp_shard": 2, "mfu": 0.45}
VERDICTS = [{"name": "mfu_floor", "passed": True, "measured": 0.4, "threshold": 0.3, "reason": "ok", "skipped": False}]
INTERRUPTIONS = [{"at": "2026-06-01T02:05:00Z", "kind": "node_lost", "detail": "n3 gone", "recovery_s": 30.0}]
DONE = {  # a finished run as the first release wrote it, every column filled (naive UTC times)
    "run_id": "done",
    "spec_hash": "s1",
    "name": "tiny-demo",
    "model": "llama2-7b",
    "cluster": "c1",
    "provider": "slurm",
    "gpu_type": "h100-80gb",
    "world_size": 8,
    "layout": "TP2·PP2·FSDP2",
    "plan": PLAN,
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
    "verdicts": VERDICTS,
    "status": "succeeded",
    "reason": None,
    "started_at": datetime(2026, 6, 1, 2, 0),
    "finished_at": datetime(2026, 6, 1, 3, 0),
    "interruptions": INTERRUPTIONS,
    "interruption_count": 1,
    "recovery_s": 30.0,
    "metrics_path": "/runs/done/metrics.jsonl",
}
RUNNING = {  # a run still open: every nullable field NULL
    **{k: None for k in DONE},
    **{"run_id": "running", "spec_hash": "s2", "name": "n", "model": "tiny", "cluster": "local"},
    **{"provider": "local", "gpu_type": "cpu", "world_size": 2, "currency": "USD", "verdicts": []},
    **{"status": "running", "started_at": datetime(2026, 6, 2, 2, 0), "interruptions": []},
    **{"interruption_count": 0, "recovery_s": 0.0},
}


def runs_table(md: MetaData) -> Table:
    """The runs table with the first release's columns (for inserting its rows as it did)."""
    cols = [Column(k, JSON if k in ("plan", "verdicts", "interruptions") else None) for k in DONE]
    cols[0] = Column("run_id", String(128), primary_key=True)
    return Table("nightloom_runs", md, *cols)


def test_a_first_release_ledger_on_postgresql_is_migrated_keeping_every_row(pg_url: str):
    eng = create_engine(pg_url)
    with eng.begin() as conn:  # the first release: the runs table and the legacy version row, no Alembic table
        command.upgrade(ledger_mod.alembic_config(conn), "0001")
        conn.execute(text(f"DROP TABLE {ledger_migrations.VERSION_TABLE}"))
        conn.execute(runs_table(MetaData()).insert(), [DONE, RUNNING])
        before = conn.execute(text("SELECT * FROM nightloom_runs ORDER BY run_id")).all()
    assert len(before) == 2

    with Ledger(pg_url) as lg:
        assert lg.schema_version() == SCHEMA_VERSION
        done = lg.get("done")
        assert done.plan == ParallelPlan.model_validate(PLAN) and done.layout == "TP2·PP2·FSDP2"
        assert [v.model_dump(mode="json", exclude_none=True) for v in done.verdicts] == VERDICTS
        assert [(i.kind, i.detail, i.recovery_s) for i in done.interruptions] == [("node_lost", "n3 gone", 30.0)]
        assert done.started_at == T0 and done.finished_at == T0 + timedelta(hours=1) and done.verified
        scalars = {k: v for k, v in DONE.items() if k not in ("plan", "verdicts", "interruptions", "started_at")}
        assert done.model_dump(include=set(scalars) - {"finished_at"}) == {
            k: v for k, v in scalars.items() if k != "finished_at"
        }
        assert (done.family, done.task, done.nights, done.figures, done.preemptions) == ("llama2", "", [], [], 0)
        running = lg.get("running")
        assert running.status == "running" and running.plan is None and running.verdicts == []
        lg.finish_run("running", status="succeeded", tokens_per_s=5.0)  # and it is writable

    with eng.connect() as conn:
        after = conn.execute(text("SELECT * FROM nightloom_runs ORDER BY run_id")).all()
        assert conn.execute(text(f"SELECT version_num FROM {ledger_migrations.VERSION_TABLE}")).all() == [("0007",)]
        assert conn.execute(text("SELECT version FROM nightloom_schema")).all() == [(SCHEMA_VERSION,)]
    eng.dispose()
    assert tuple(after[0][: len(before[0])]) == tuple(before[0])  # `done`: every first-release field as it was


def test_every_revision_runs_on_postgresql_both_ways_and_head_matches_the_models(pg_url: str):
    with Ledger(pg_url) as lg:
        lg.start_run(run_id="r", spec_hash="s", name="n", model="tiny", cluster="c", provider="local",
                     gpu_type="cpu", world_size=1, started_at=T0)  # fmt: skip
        with lg.engine.begin() as conn:
            command.downgrade(ledger_mod.alembic_config(conn), "0001")  # 0007 ... 0002 down, on PostgreSQL
        with lg.engine.connect() as conn:
            assert conn.execute(select(text("run_id")).select_from(text("nightloom_runs"))).all() == [("r",)]
    with Ledger(pg_url) as lg:  # and up again, each revision
        assert lg.schema_version() == SCHEMA_VERSION and lg.get("r").started_at == T0
        with lg.engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": ledger_migrations.VERSION_TABLE})
            assert compare_metadata(ctx, [ledger_mod.Base.metadata, queue_metadata]) == []


def test_a_serialization_failure_is_run_again(pg_url: str):
    """Two SERIALIZABLE transactions on one row: the second to commit fails with SQLSTATE 40001 and `retry` runs
    it again, which then sees the first one's write."""
    eng = create_engine(pg_url)
    with eng.begin() as c:
        c.execute(text("CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)"))
        c.execute(text("INSERT INTO counter VALUES (1, 0)"))
    attempts = []

    def tx() -> int:
        with eng.connect().execution_options(isolation_level="SERIALIZABLE") as conn, conn.begin():
            n = conn.execute(text("SELECT n FROM counter WHERE id = 1")).scalar_one()
            attempts.append(n)
            if len(attempts) == 1:  # another writer commits in between, on its own connection
                with eng.connect().execution_options(isolation_level="SERIALIZABLE") as other, other.begin():
                    other.execute(text("UPDATE counter SET n = n + 10 WHERE id = 1"))
            conn.execute(text("UPDATE counter SET n = :n WHERE id = 1"), {"n": n + 1})
            return n + 1

    assert ledger_mod.retry(tx, retries=3) == 11
    assert attempts == [0, 10]
    with eng.connect() as c:
        assert c.execute(text("SELECT n FROM counter")).scalar_one() == 11
    eng.dispose()


WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from nightloom.ledger import Ledger, LedgerError
    from nightloom.queue.jobs import QueuedJob
    from nightloom.queue.store import QueueError, QueueStore
    from nightloom.spec import ScheduleSpec
    from nightloom.gates import Verdict
    url, who, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    sched = ScheduleSpec(policy="split", timezone="UTC", price_per_gpu_hour=1.0)
    while not go.exists():
        time.sleep(0.005)
    lg = Ledger(url)  # a new ledger: the writers race on its migration too
    store = QueueStore(lg)
    try:
        lg.start_run(run_id="shared", spec_hash="s", name="n", model="tiny", cluster="c", provider="local",
                     gpu_type="cpu", world_size=2)
        print("created shared")
    except LedgerError:
        pass
    try:
        store.create("team", 4)
    except QueueError:
        pass
    ok = [Verdict(name="g", passed=True, reason="ok")]
    for i in range(n):
        rid = f"{who}-{i}"
        lg.start_run(run_id=rid, spec_hash="s", name="n", model="tiny", cluster="c", provider="local",
                     gpu_type="cpu", world_size=2)
        if i % 5 == 0:
            lg.record_interruption("shared", kind=who, recovery_s=1.0)
        lg.finish_run(rid, status="succeeded", tokens_per_s=float(i), verdicts=ok)
        if i % 10 == 0:
            job = QueuedJob(name=rid, spec_hash="h", nodes=1, gpus=8, policy="split", steps=10, step_time_s=1.0,
                            hours_source="given", provisioning_s=0.0, checkpoint_s=0.0, restore_s=0.0,
                            schedule=sched)
            store.add("team", job, spec={"name": rid})
    lg.close()
""")


@pytest.mark.timeout(300)
def test_eight_writers_fifty_runs_each_at_once_lose_nothing(pg_url: str, tmp_path: Path):
    """8 processes open one new PostgreSQL ledger at once (racing on its migration) and write it: each starts and finishes 50 runs, appends an interruption
    to one shared row every 5th run (a read-modify-write) and adds 5 jobs to one queue (checked against the queue in the
    transaction that inserts them)."""
    go, writers, n = tmp_path / "go", 8, 50
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, pg_url, f"w{k}", str(n), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for k in range(writers)
    ]
    time.sleep(1.0)
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        outs.append(out)
    assert sum(o.count("created shared") for o in outs) == 1
    with Ledger(pg_url) as lg:
        with lg.engine.connect() as conn:  # migrated once
            assert conn.execute(text(f"SELECT version_num FROM {ledger_migrations.VERSION_TABLE}")).all() == [("0007",)]
            assert conn.execute(text("SELECT id, version FROM nightloom_schema")).all() == [(1, SCHEMA_VERSION)]
        runs = [r for r in lg.list_runs() if r.run_id != "shared"]
        assert len(runs) == writers * n == 400
        assert all(r.status == "succeeded" and r.verified for r in runs)
        shared = lg.get("shared")
        assert shared.interruption_count == len(shared.interruptions) == writers * n // 5
        assert sorted({i.kind for i in shared.interruptions}) == [f"w{k}" for k in range(writers)]
        jobs = QueueStore(lg).jobs("team")
        assert len(jobs) == writers * 5 and len({j.id for j in jobs}) == 40
        assert {j.name for j in jobs} == {f"w{k}-{i}" for k in range(writers) for i in range(0, n, 10)}


MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
server:/export/team /mnt/team nfs4 rw,relatime,vers=4.2 0 0
//nas/share /mnt/team/smb cifs rw 0 0
me@host:/data /home/me/remote\\040dir fuse.sshfs rw 0 0
tmpfs /tmp tmpfs rw 0 0
"""


def test_a_network_filesystem_is_recognised_by_its_longest_mount_point():
    nfs = ledger_mod.network_filesystem
    assert nfs(Path("/mnt/team/ledgers"), MOUNTS) == "nfs4"
    assert nfs(Path("/mnt/team/smb/l"), MOUNTS) == "cifs"  # the longer mount point wins
    assert nfs(Path("/home/me/remote dir/x"), MOUNTS) == "fuse.sshfs"  # octal-escaped spaces
    assert nfs(Path("/mnt/teamwork"), MOUNTS) is None  # a prefix of the name is not a mount point above it
    assert nfs(Path("/tmp/l"), MOUNTS) is None and nfs(Path("/srv"), MOUNTS) is None


def test_a_sqlite_ledger_on_a_network_filesystem_is_warned_about(tmp_path: Path, caplog, monkeypatch):
    mounts = tmp_path / "mounts"  # the mount table as /proc/self/mounts gives it, the ledger's folder on NFS
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/x {tmp_path / 'team'} nfs4 rw 0 0\n")
    monkeypatch.setattr(ledger_mod, "MOUNTS", mounts)
    with caplog.at_level("WARNING", logger="nightloom.ledger.engine"):
        Ledger(f"sqlite:///{tmp_path / 'local' / 'l.db'}").close()
        assert "network filesystem" not in caplog.text
        Ledger(f"sqlite:///{tmp_path / 'team' / 'l.db'}").close()
    assert "a SQLite file on a network filesystem (nfs4)" in caplog.text and "PostgreSQL" in caplog.text
