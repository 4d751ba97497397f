"""The run ledger: typed rows, best layout, calibration, CSV export, schema version, concurrent writers; each on
SQLite and on PostgreSQL (the `ledger_url` fixture, tests/support/postgres.py)."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from nightloom.gates import Verdict
from nightloom.ledger import SCHEMA_VERSION, Ledger, LedgerError, RunRecord, model_family
from nightloom.ledger.engine import where
from nightloom.parallel import ParallelPlan

T0 = datetime(2026, 6, 1, 2, 0, tzinfo=UTC)
OK = [
    Verdict(name="mfu_floor", passed=True, measured=0.4, threshold=0.3, reason="ok"),
    Verdict(name="loss_drop", passed=True, measured=0.3, threshold=0.05, reason="ok"),
]
BAD = [Verdict(name="loss_drop", passed=False, measured=0.0, threshold=0.05, reason="flat")]
SKIPPED = [
    Verdict(name="mfu_floor", passed=True, skipped=True, measured=0.4, threshold=0.0, reason="no floor set"),
    Verdict(name="grad_norm", passed=True, skipped=True, reason="grad_norm_max not set"),
]


@pytest.fixture
def ledger(ledger_url: str):
    with Ledger(ledger_url) as lg:
        yield lg


def start(
    lg: Ledger, run_id: str, *, model="llama2-7b", cluster="c1", gpu="h100-80gb", plan=None, minutes=0, **kw
) -> RunRecord:
    return lg.start_run(
        run_id=run_id,
        spec_hash="h" + model,
        name="n",
        model=model,
        cluster=cluster,
        provider="slurm",
        gpu_type=gpu,
        world_size=8,
        plan=plan,
        started_at=T0 + timedelta(minutes=minutes),
        **kw,
    )


def test_start_update_finish_roundtrip_typed(ledger: Ledger):
    plan = ParallelPlan(tp=2, pp=2, dp_shard=2, mfu=0.45)
    rec = start(ledger, "r1", plan=plan, time_to_ready_s=42.0, metrics_path="/runs/r1/metrics.jsonl")
    assert isinstance(rec, RunRecord) and rec.status == "running" and rec.predicted_mfu == 0.45
    assert rec.layout == "TP2·PP2·FSDP2" and rec.plan == plan and rec.started_at == T0
    rec = ledger.update_run("r1", cost=12.5, currency="CNY")
    assert rec.cost == 12.5 and rec.currency == "CNY"
    rec = ledger.record_interruption(
        "r1", kind="node_lost", detail="n3 gone", recovery_s=30.0, at=T0 + timedelta(minutes=5)
    )
    rec = ledger.finish_run(
        "r1",
        status="succeeded",
        measured_mfu=0.41,
        hfu=0.5,
        tokens_per_s=1e5,
        duration_s=3600,
        verdicts=OK,
        precision="bf16",
        peak_source="datasheet: H100",
        final_loss=2.1,
        finished_at=T0 + timedelta(hours=1),
    )
    got = ledger.get("r1")
    assert got == rec
    assert got.verdicts == OK and got.verified
    assert got.interruption_count == 1 and got.recovery_s == 30.0
    assert got.interruptions[0].kind == "node_lost" and got.interruptions[0].at == T0 + timedelta(minutes=5)
    assert got.finished_at.tzinfo is not None and got.cost == 12.5  # finish kept the earlier cost
    assert ledger.schema_version() == SCHEMA_VERSION


def test_bad_writes_are_clear_errors(ledger: Ledger):
    start(ledger, "r1")
    with pytest.raises(LedgerError, match="'r1' is already in the ledger"):
        start(ledger, "r1")
    with pytest.raises(LedgerError, match="no run 'nope'"):
        ledger.finish_run("nope", status="failed")
    with pytest.raises(LedgerError, match=r"cannot set \['bogus'\]"):
        ledger.update_run("r1", bogus=1)
    with pytest.raises(ValueError, match="status"):
        ledger.update_run("r1", status="exploded")
    assert ledger.get("r1").status == "running"


def test_best_is_the_fastest_verified_layout(ledger: Ledger):
    rows = [  # (id, model, cluster, tokens/s, status, verdicts)
        ("slow-ok", "llama2-7b", "c1", 1.0e5, "succeeded", OK),
        ("fast-ok", "llama2-7b", "c1", 1.5e5, "succeeded", OK),
        ("faster-failed-gate", "llama2-7b", "c1", 3.0e5, "succeeded", BAD),
        ("fastest-crashed", "llama2-7b", "c1", 4.0e5, "failed", OK),
        ("no-gates", "llama2-7b", "c1", 5.0e5, "succeeded", []),
        ("all-skipped", "llama2-7b", "c1", 6.0e5, "succeeded", SKIPPED),
        ("other-cluster", "llama2-7b", "c2", 9.0e5, "succeeded", OK),
        ("other-model", "llama3-8b", "c1", 9.0e5, "succeeded", OK),
    ]
    for i, (rid, model, cluster, tps, status, vs) in enumerate(rows):
        start(ledger, rid, model=model, cluster=cluster, plan=ParallelPlan(tp=2, dp_shard=4), minutes=i)
        ledger.finish_run(rid, status=status, tokens_per_s=tps, verdicts=vs)
    best = ledger.best("llama2-7b", "c1")
    assert best.run_id == "fast-ok" and best.layout == "TP2·PP1·FSDP4"
    assert ledger.best("llama2-70b", "c1") is None
    assert [r.run_id for r in ledger.list_runs(cluster="c1", limit=3)] == ["other-model", "all-skipped", "no-gates"]
    assert not ledger.get("all-skipped").verified  # every gate skipped proves nothing


def test_calibration_is_bounded_and_per_family(ledger: Ledger):
    for i, (model, gpu, pred, meas, vs) in enumerate(
        [
            ("llama2-7b", "h100-80gb", 0.50, 0.40, OK),
            ("llama2-13b", "h100-80gb", 0.50, 0.45, OK),
            ("llama2-70b", "h100-80gb", 0.50, 0.30, OK),
            ("llama2-7b", "h100-80gb", 0.50, 0.05, BAD),  # not verified: ignored
            ("llama2-7b", "a100-80gb", 0.50, 0.10, OK),  # other GPU
            ("llama3-8b", "h100-80gb", 0.50, 0.50, OK),  # other family
        ]
    ):
        start(ledger, f"r{i}", model=model, gpu=gpu, plan=ParallelPlan(dp_shard=8, mfu=pred), minutes=i)
        ledger.finish_run(f"r{i}", status="succeeded", measured_mfu=meas, tokens_per_s=1.0, verdicts=vs)
    cal = ledger.calibration("h100-80gb", "llama2")
    assert cal.runs == 3 and cal.factor == pytest.approx(0.8) and not cal.clipped
    low = ledger.calibration("a100-80gb", "llama2")
    assert low.raw_median == pytest.approx(0.2) and low.factor == 0.25 and low.clipped
    assert ledger.calibration("h100-80gb", "mistral") is None
    assert ledger.calibration("h100-80gb", "llama2", min_runs=4) is None
    assert model_family("llama2-70b") == "llama2" and model_family("tiny") == "tiny"


def test_export_csv_atomic_and_parseable(ledger: Ledger, tmp_path: Path):
    start(ledger, "r1", plan=ParallelPlan(tp=2, dp_shard=4))
    ledger.finish_run("r1", status="succeeded", verdicts=OK, tokens_per_s=1.0, cost=3.5)
    start(ledger, "r2", minutes=1)
    out = tmp_path / "x" / "runs.csv"
    textual = ledger.export_csv(out)
    assert out.read_text() == textual
    rows = list(csv.DictReader(io.StringIO(textual)))
    assert [r["run_id"] for r in rows] == ["r2", "r1"]
    assert json.loads(rows[1]["verdicts"])[0]["name"] == "mfu_floor"
    assert json.loads(rows[1]["plan"])["tp"] == 2 and rows[1]["cost"] == "3.5"
    assert not list(out.parent.glob(".*tmp"))


def test_golden_run_of_a_spec(ledger: Ledger):
    start(ledger, "a", metrics_path="/m/a.jsonl")
    ledger.finish_run("a", status="succeeded", verdicts=OK, tokens_per_s=10.0)
    start(ledger, "b", metrics_path=None, minutes=1)
    ledger.finish_run("b", status="succeeded", verdicts=OK, tokens_per_s=20.0)
    assert ledger.golden_run("hllama2-7b").run_id == "a"
    assert ledger.golden_run("other") is None


def test_newer_schema_is_refused(ledger_url: str):
    url = ledger_url
    Ledger(url).close()
    eng = create_engine(url)
    newer = f"{SCHEMA_VERSION + 1:04d}"  # what a newer nightloom's Alembic revision would leave
    with eng.begin() as c:
        c.execute(text("UPDATE nightloom_alembic_version SET version_num = :v"), {"v": newer})
        c.execute(text("UPDATE nightloom_schema SET version = :v"), {"v": SCHEMA_VERSION + 1})
    eng.dispose()
    shown = re.escape(where(url))  # the URL as messages show it (no password)
    with pytest.raises(LedgerError, match=f"ledger {shown} is at schema revision '{newer}'.*upgrade nightloom"):
        Ledger(url)


WRITER = textwrap.dedent("""
    import sys, time
    from datetime import UTC, datetime
    from pathlib import Path
    from nightloom.ledger import Ledger, LedgerError
    from nightloom.gates import Verdict
    url, who, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    while not go.exists():
        time.sleep(0.005)
    lg = Ledger(url)
    try:
        lg.start_run(run_id="shared", spec_hash="s", name="n", model="tiny", cluster="c", provider="local",
                     gpu_type="cpu", world_size=2)
        print("created shared")
    except LedgerError:
        pass
    ok = [Verdict(name="g", passed=True, reason="ok")]
    for i in range(n):
        rid = f"{who}-{i}"
        lg.start_run(run_id=rid, spec_hash="s", name="n", model="tiny", cluster="c", provider="local",
                     gpu_type="cpu", world_size=2)
        lg.record_interruption("shared", kind=who, recovery_s=1.0)
        lg.finish_run(rid, status="succeeded", tokens_per_s=float(i), verdicts=ok)
    lg.close()
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_processes_writing_at_once(ledger_url: str, tmp_path: Path):
    url = ledger_url  # not created yet: both race on the schema too
    go, n = tmp_path / "go", 25
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, url, who, str(n), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[3],
        )
        for who in ("a", "b")
    ]
    time.sleep(0.5)  # both interpreters are up and polling
    go.touch()
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=100)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        assert p.returncode == 0, err
        outs.append(out)
    assert sum(o.count("created shared") for o in outs) == 1
    with Ledger(url) as lg:
        runs = lg.list_runs()
        assert len(runs) == 2 * n + 1
        assert all(r.status == "succeeded" and r.verified for r in runs if r.run_id != "shared")
        shared = lg.get("shared")
        assert shared.interruption_count == 2 * n and len(shared.interruptions) == 2 * n
        assert shared.recovery_s == pytest.approx(2 * n)
        assert sorted(i.kind for i in shared.interruptions) == ["a"] * n + ["b"] * n


# ---------------------------------------------------------------------------------------------- `nightloom ledger`


def test_ledger_cli_list_best_export(tmp_path: Path, capsys):
    from flows.cli import main

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    with Ledger(url) as lg:
        for i, (rid, tps, vs) in enumerate([("a", 10.0, OK), ("b", 30.0, OK), ("c", 99.0, BAD)]):
            start(lg, rid, plan=ParallelPlan(tp=2, dp_shard=4), minutes=i)
            lg.finish_run(rid, status="succeeded", tokens_per_s=tps, verdicts=vs, cost=1.0 + i)
    assert main(["ledger", "--url", url, "best", "--model", "llama2-7b", "--cluster", "c1", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert best["run_id"] == "b" and best["plan"]["tp"] == 2
    assert main(["ledger", "list", "--url", url, "--json", "--limit", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in rows] == ["c", "b"] and rows[0]["verified"] is False
    assert main(["ledger", "--url", url, "list"]) == 0
    assert "TP2·PP1·FSDP4" in capsys.readouterr().out
    out = tmp_path / "runs.csv"
    assert main(["ledger", "--url", url, "export", "--out", str(out)]) == 0
    assert [r["run_id"] for r in csv.DictReader(out.open())] == ["c", "b", "a"]
    assert main(["ledger", "--url", url, "best", "--model", "llama3-8b", "--cluster", "c1"]) == 1
    assert "no verified run of llama3-8b" in capsys.readouterr().err


def test_ledger_cli_url_from_spec(tmp_path: Path, capsys):
    from flows.cli import main

    db = tmp_path / "from-spec.db"
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: x\ndataset: {{path: d, sample: true}}\nledger: {{url: 'sqlite:///{db}'}}\n")
    assert main(["ledger", "--spec", str(spec), "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [] and db.exists()
    assert main(["ledger", "--spec", str(tmp_path / "nope.yaml"), "list"]) == 2
