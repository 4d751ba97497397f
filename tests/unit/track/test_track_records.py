"""The trackers' settings and records without a server: the spec's `track` (names, refusals), what tracking.json
and the summary say, the ledger figures that name each tracker's run, credentials kept out of everything written."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from nightloom.gates import Verdict
from nightloom.parallel import ParallelPlan
from nightloom.spec import RunSpec
from nightloom.spec.tracking import TrackSpec
from nightloom.track.finish import flat_params, verdict_values
from nightloom.track.records import (
    TrackerStatus,
    TrackingFile,
    scrub,
    secret_env,
    step_ranges,
    tracker_figures,
    tracker_runs,
)


def spec(**kw) -> RunSpec:
    return RunSpec.model_validate({"name": "t", "dataset": {"path": "d"}, **kw})


def test_track_names_turn_trackers_on_and_bad_settings_are_refused_by_path():
    assert spec(track=["mlflow", "tensorboard"]).track.enabled() == ["mlflow", "tensorboard"]
    assert spec().track.enabled() == [] and spec(track={"wandb": {}}).track.wandb.mode == "offline"
    with pytest.raises(ValidationError, match=r"track\n.*unknown tracker\(s\) \['neptune'\]"):
        spec(track=["mlflow", "neptune"])
    with pytest.raises(ValidationError, match=r"track.mlflow.tracking_uri\n.*holds a password"):
        spec(track={"mlflow": {"tracking_uri": "https://me:hunter2@mlflow.example:5000"}})
    with pytest.raises(ValidationError, match=r"track.wandb.mode"):
        spec(track={"wandb": {"mode": "disabled"}})


def test_what_was_lost_is_said_by_step_and_summed_over_attempts(tmp_path: Path):
    assert step_ranges([9, 4, 5, 6, 11, 12, 4]) == "4-6, 9, 11-12" and step_ranges([]) == ""
    lost = TrackerStatus(tracker="mlflow", run_id="abc", sent=3, lost=4, lost_steps="4-7", failures=6, error="down")
    assert lost.note() == "mlflow run abc: 3 rows sent after 6 failed tries; 4 LOST (steps 4-7): down"
    assert TrackerStatus(tracker="wandb", run_id="x", sent=7).note() == "wandb run x: 7 rows sent"
    f = TrackingFile(runs={"mlflow": "abc"}, attempts=[[lost], [lost.model_copy(update={"lost": 1})]])
    f.save(tmp_path)
    assert TrackingFile.load(tmp_path) == f and f.lost() == {"mlflow": 5}


def test_the_ledger_row_names_each_trackers_run_in_its_figures():
    statuses = [TrackerStatus(tracker="mlflow", run_id="3f2a", lost=2), TrackerStatus(tracker="wandb", run_id=None)]
    figs = tracker_figures(statuses + [TrackerStatus(tracker="tensorboard", run_id="/runs/r/tensorboard")])
    assert [(f.name, f.value) for f in figs] == [
        ("track/mlflow/3f2a", 2.0),
        ("track/tensorboard//runs/r/tensorboard", 0.0),
    ]
    assert tracker_runs(figs) == {"mlflow": "3f2a", "tensorboard": "/runs/r/tensorboard"}


def test_credentials_come_from_blocks_or_the_environment_and_are_scrubbed(monkeypatch):
    track = TrackSpec.model_validate({"mlflow": {"token_secret": "mlflow-token"}, "wandb": {}})
    blocks = {"mlflow-token": "tok-123456"}
    assert secret_env(track, blocks.__getitem__) == {"MLFLOW_TRACKING_TOKEN": "tok-123456"}
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert scrub(f"401 for key {'k' * 40} and password=pw1 token=abc") == "401 for key *** and password=*** token=***"


def test_params_are_the_resolved_spec_and_plan_without_the_ledger_password():
    s = spec(ledger={"url": "postgresql+psycopg://team:s3cret@db:5432/ledger"}, track=["mlflow"])
    params = flat_params(s, ParallelPlan(tp=2, micro_batch=2))
    assert params["spec.name"] == "t" and params["plan.tp"] == "2" and params["spec.train.lr"] == str(s.train.lr)
    assert params["spec.ledger.url"] == "postgresql+psycopg://team:***@db:5432/ledger"
    assert not any("s3cret" in v for v in params.values())
    verdicts = [
        Verdict(name="loss_drop", passed=False, measured=0.01, threshold=0.05, reason="flat"),
        Verdict(name="mfu_floor", passed=True, skipped=True, reason="no floor"),
    ]
    assert verdict_values(verdicts, []) == {"verdict/loss_drop/passed": 0.0, "verdict/loss_drop/measured": 0.01}


def test_a_failed_run_ends_the_tracker_runs_its_training_opened(tmp_path: Path):
    from tasks.record import track_failed

    s = spec(storage={"root": str(tmp_path)}, track=["tensorboard"])
    assert track_failed(s, "r1", "failed", "no nodes") == []  # training never opened a tracker run: nothing to end
    run_dir = tmp_path / "r1"
    TrackingFile(runs={"tensorboard": str(run_dir / "tensorboard")}).save(run_dir)
    (status,) = track_failed(s, "r1", "failed", "ProvisionError: node local-0 lost")
    assert (status.tracker, status.run_id, status.error) == ("tensorboard", str(run_dir / "tensorboard"), None)
    assert '"status": "failed"' in (run_dir / "summary.json").read_text()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_an_mlflow_tracker_with_no_server_anywhere_is_refused_at_validate():
    from nightloom.spec.tracking import track_errors

    why = "not set, and MLFLOW_TRACKING_URI is not in the environment"
    assert track_errors({"track": ["mlflow"]}, {}) == [(("track", "mlflow", "tracking_uri"), why)]
    assert track_errors({"track": {"mlflow": {"experiment": "x"}}}, {}) == [(("track", "mlflow", "tracking_uri"), why)]
    assert track_errors({"track": ["mlflow"]}, {"MLFLOW_TRACKING_URI": "http://m:5000"}) == []
    assert track_errors({"track": {"mlflow": {"tracking_uri": "http://m:5000"}}}, {}) == []
    assert track_errors({"track": ["wandb"]}, {}) == [] and track_errors({}, {}) == []
