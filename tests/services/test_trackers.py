"""The trackers (track: mlflow, wandb, tensorboard) against a real MLflow server (CI's, .ci/services.sh), W&B in
offline mode and TensorBoard's event files: one real training run reports to all three while MLflow is stopped
mid-run for steps 3-5 (a proxy whose connections are cut and refused, then back): training never waits on it,
MLflow gets every step once back, and MLflow's REST API, W&B's offline files and TensorBoard's event reader each give the losses of
metrics.jsonl; the flow's end adds params, verdicts and artifacts; a planted credential is in no file of the run
folder, the ledger or the logs. A tracker that never comes back is reported lost, step by step."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import pytest

from nightloom.gates import Verdict
from nightloom.ledger import Ledger
from nightloom.metrics import read_metrics
from nightloom.parallel import ParallelPlan
from nightloom.spec import RunSpec
from nightloom.spec.tracking import TrackSpec
from nightloom.track.attempt import AttemptTrackers
from nightloom.track.finish import RunEnd, finish_trackers
from nightloom.track.records import TrackingFile, tracker_figures, tracker_runs
from nightloom.train.reporting import StepRecord, StepReporter
from tests.support.harness import launch, make_job, write_corpus
from tests.support.trackers import (
    Outage,
    mlflow_get,
    mlflow_history,
    mlflow_uri,
    tensorboard_scalars,
    wandb_history,
)

STEPS = 8


def stop_mid_run(outage: Outage, metrics: Path, down_at: int, up_at: int, stop: threading.Event) -> None:
    """Take the proxy down once the trainer has written `down_at` steps (MLflow stopped mid-run) and bring it back
    at `up_at` (the steps between were trained while MLflow was down)."""
    for steps, change in ((down_at, outage.down), (up_at, outage.up)):
        while not stop.is_set():
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                break
            time.sleep(0.02)
        change()


def test_one_run_reports_to_all_three_trackers_through_an_mlflow_outage(tmp_path: Path, monkeypatch):
    uri = mlflow_uri()
    token = "nlplanted" + secrets.token_hex(12)  # a credential in the environment, searched for afterwards
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", token)
    monkeypatch.setenv("WANDB_API_KEY", token + "x" * 10)
    outage = Outage(uri)
    outage.up()  # up at the start, stopped after step 2, back after step 5
    experiment = f"nl-test-{secrets.token_hex(4)}"
    track = TrackSpec.model_validate(
        {"mlflow": {"tracking_uri": outage.url, "experiment": experiment}, "wandb": {}, "tensorboard": {}}
    )
    run_dir = tmp_path / "runs" / "tracked"
    job = make_job(
        run_dir, write_corpus(tmp_path / "data"), steps=STEPS, job_kw={"track": track}, micro_batch=2, grad_accum=4
    )
    stop = threading.Event()
    watcher = threading.Thread(target=stop_mid_run, args=(outage, run_dir / "metrics.jsonl", 2, 5, stop))
    watcher.start()
    try:
        out = launch(1, job, timeout=240)
    finally:
        stop.set()
        watcher.join()
    losses = {m.step: m.loss for m in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(losses) == list(range(1, STEPS + 1))

    tracking = TrackingFile.load(run_dir)
    status = {s.tracker: s for s in tracking.attempts[0]}
    assert status["mlflow"].failures >= 1 and status["mlflow"].lost == 0 and status["mlflow"].sent == STEPS
    assert all(status[t].sent == STEPS and status[t].lost == 0 for t in ("wandb", "tensorboard"))
    assert "tracker mlflow run" in out.output and "LOST" not in out.output

    run_id = tracking.runs["mlflow"]
    assert mlflow_history(uri, run_id, "loss") == pytest.approx(losses, rel=1e-6)
    assert {s: h["loss"] for s, h in wandb_history(run_dir).items()} == pytest.approx(losses, rel=1e-6)
    assert tensorboard_scalars(run_dir / "tensorboard", "train/loss") == pytest.approx(losses, rel=1e-6)

    # the flow's end: the same runs get the spec and plan, the verdicts, the summary and plots, and their end
    spec = RunSpec.model_validate({"name": "tracked", "dataset": {"path": str(tmp_path / "data")}, "track": track})
    verdicts = [Verdict(name="loss_drop", passed=True, measured=0.5, threshold=0.05, reason="ok")]
    summary = {"run_id": "tracked", "status": "completed", "steps": STEPS, "last_loss": losses[STEPS]}
    end = RunEnd(spec, "tracked", run_dir, ParallelPlan(micro_batch=2, grad_accum=4), True, summary, verdicts)
    ends = {s.tracker: s for s in finish_trackers(end)}
    assert all(s.error is None and s.lost == 0 and s.sent == STEPS for s in ends.values()), ends
    run = mlflow_get(uri, "runs/get", run_id=run_id)["run"]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert (
        run["info"]["status"] == "FINISHED" and params["plan.micro_batch"] == "2" and params["spec.name"] == "tracked"
    )
    assert tags["nightloom.run_id"] == "tracked" and mlflow_history(uri, run_id, "verdict/loss_drop/passed") == {
        STEPS: 1.0
    }
    files = {f["path"] for f in mlflow_get(uri, "artifacts/list", run_id=run_id).get("files", [])}
    assert "summary.json" in files

    # the ledger row keeps each tracker's run id; no file of the run folder, the ledger or the logs holds the token
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as lg:
        lg.start_run(run_id="tracked", spec_hash=spec.spec_hash(), name="tracked", model="tiny", cluster="local",
                     provider="local", gpu_type="cpu", world_size=1)  # fmt: skip
        row = lg.finish_run("tracked", status="succeeded", figures=tracker_figures(list(ends.values())))
        assert tracker_runs(row.figures)["mlflow"] == run_id
    files = [p for p in (tmp_path).rglob("*") if p.is_file()]
    assert len(files) > 20
    leaked = [str(p) for p in files if token.encode() in p.read_bytes()]
    assert not leaked and token not in out.output


def record(step: int) -> StepRecord:
    return StepRecord(
        step=step, total_steps=5, loss=3.0 - step / 10, grad_norm=1.0, lr=1e-3, tokens=64, tokens_per_s=1e3,
        label_tokens=64, label_tokens_per_s=1e3, flops=1.0, hardware_flops=1.0, step_time_s=0.1, peak_mem_bytes=1e6,
        local_mem_bytes=10**6, mfu=0.1, hfu=0.1, time=time.time(), attempt=0, gap=False, world_size=1,
        collective_latency_s=0.0,
    )  # fmt: skip


def test_an_mlflow_that_never_comes_back_is_reported_lost_step_by_step(tmp_path: Path):
    outage = Outage(mlflow_uri())  # never up
    track = TrackSpec.model_validate({"mlflow": {"tracking_uri": outage.url}, "flush_s": 1.0})
    trackers = AttemptTrackers(track, tmp_path, "gone")
    reporter = StepReporter(trackers.sinks)
    for step in range(1, 6):
        reporter.emit(record(step))  # returns at once: the rows wait in the buffer
    (status,) = trackers.close()
    assert (status.tracker, status.sent, status.lost, status.lost_steps) == ("mlflow", 0, 5, "1-5")
    assert status.failures >= 1 and "Connection" in (status.error or "")
    assert "5 LOST (steps 1-5)" in status.note()
    spec = RunSpec.model_validate({"name": "gone", "dataset": {"path": "d"}, "track": track})
    (end,) = finish_trackers(RunEnd(spec, "gone", tmp_path, None, False, {"steps": 5}))
    assert end.lost == 5 and end.lost_steps == "1-5" and end.run_id is None and "end of run" in (end.error or "")
    assert TrackingFile.load(tmp_path).lost() == {"mlflow": 5}
