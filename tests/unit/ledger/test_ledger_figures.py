"""Schema 7: each run's task and its figures. A schema-6 ledger opens with every row whole, the task read back from
the run folder's job file where one is left; figures (a preference run's reward accuracy, a benchmark's base and
tuned score) round-trip through finish_run."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from sqlalchemy import create_engine

from nightloom.ledger import Figure, Ledger
from nightloom.ledger import engine as ledger_mod

T0 = datetime(2026, 12, 5, 2, 0, tzinfo=UTC)


def _start(lg: Ledger, run_id: str, metrics_path: str | None = None, task: str = "") -> None:
    lg.start_run(
        run_id=run_id,
        spec_hash="h",
        name="n",
        model="tiny",
        cluster="local",
        provider="local",
        gpu_type="cpu",
        world_size=1,
        task=task,
        started_at=T0,
        metrics_path=metrics_path,
    )


def _columns(db: Path) -> list[str]:
    with closing(sqlite3.connect(db)) as con:
        return [r[1] for r in con.execute("PRAGMA table_info(nightloom_runs)")]


def test_a_schema_6_ledger_gains_the_task_its_run_folder_trained_and_loses_nothing(tmp_path: Path):
    db = tmp_path / "l.db"
    url = f"sqlite:///{db}"
    folder = tmp_path / "runs" / "chat"
    folder.mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps({"train": {"task": "sft", "backend": "native"}}))
    xt = tmp_path / "runs" / "xt"
    xt.mkdir()
    (xt / "job.json").write_text(json.dumps({"train": {"task": "pretrain", "backend": "xtuner"}}))
    with Ledger(url) as lg:
        _start(lg, "chat", str(folder / "metrics.jsonl"))
        _start(lg, "xt", str(xt / "metrics.jsonl"))
        _start(lg, "gone", str(tmp_path / "nowhere" / "metrics.jsonl"))
        lg.finish_run("gone", status="succeeded", final_loss=2.5, cost=1.25)
    eng = create_engine(url)
    with eng.begin() as conn:
        command.downgrade(ledger_mod.alembic_config(conn), "0006")
    eng.dispose()
    assert "task" not in _columns(db) and "figures" not in _columns(db)
    with closing(sqlite3.connect(db)) as con:
        before = con.execute("SELECT * FROM nightloom_runs ORDER BY run_id").fetchall()

    with Ledger(url) as lg:  # opened by this nightloom: migrated to schema 7
        got = {r.run_id: (r.task, r.figures) for r in lg.list_runs()}
        assert got == {"chat": ("sft", []), "xt": ("sft", []), "gone": ("", [])}
        gone = lg.get("gone")
        assert (gone.final_loss, gone.cost, gone.status) == (2.5, 1.25, "succeeded")
    with closing(sqlite3.connect(db)) as con:
        after = con.execute("SELECT * FROM nightloom_runs ORDER BY run_id").fetchall()
    assert [row[: len(before[0])] for row in after] == before  # every older column of every row as it was


def test_figures_and_task_round_trip(ledger_url: str):
    with Ledger(ledger_url) as lg:
        _start(lg, "pref", task="dpo")
        figs = [
            Figure(name="rewards/accuracies", value=0.75, stderr=0.05),
            Figure(name="bench/arc/acc", value=0.41, base=0.38, stderr=0.02),
        ]
        lg.finish_run("pref", status="succeeded", figures=figs)
        rec = lg.get("pref")
        assert rec.task == "dpo" and rec.figures == figs
        assert rec.figures[1].base == 0.38
