"""The whole flow on the embedded default (smaller: fewer steps), asserting on what each stage wrote."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.pipeline import artifacts_of, demo_data, small_demo
from tests.support.trackers import (
    flow_tracking,
    mlflow_get,
    mlflow_history,
    mlflow_uri,
    tensorboard_scalars,
    wandb_history,
)

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "nlplanted" + secrets.token_hex(12)  # a tracker credential in the run's environment, searched for after it


@pytest.fixture(scope="module")
def demo_run(prefect_backend, tmp_path_factory):
    """One pipeline run of the embedded default (fewer steps), shared by the tests that only read what it left."""
    from flows.pipeline import training_pipeline

    tmp_path = tmp_path_factory.mktemp("demo")
    spec = small_demo(tmp_path)  # track: the run reports to MLflow (CI's server), W&B offline and TensorBoard
    track = flow_tracking(f"nl-flow-{secrets.token_hex(4)}")
    spec.write_text(yaml.safe_dump(yaml.safe_load(spec.read_text()) | {"track": track}))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
        env.setenv("WANDB_API_KEY", TOKEN + "x" * 10)
        state = training_pipeline(str(spec), return_state=True)
    return tmp_path, state


def test_full_pipeline_on_embedded_default(demo_run):
    from nightloom.ledger import Ledger
    from nightloom.metrics import read_metrics
    from nightloom.sharding.manifest import load_manifest
    from nightloom.track.records import tracker_runs

    tmp_path, state = demo_run
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.status == "completed"

    # shard: 8 Parquet shards + manifest, balanced
    manifest = load_manifest(tmp_path / "shards")
    assert manifest.num_shards == 8 and manifest.balanced
    assert all((tmp_path / "shards" / s.path).is_file() for s in manifest.shards)

    # train: metrics for every step, loss decreasing, a checkpoint
    run_dir = Path(summary.run_dir)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m.step for m in metrics] == list(range(1, 13))
    assert metrics[-1].loss < metrics[0].loss
    assert summary.last_loss == pytest.approx(metrics[-1].loss)
    assert all(m.mfu is not None and 0 < m.mfu < 1 for m in metrics[1:])

    # record: a ledger row with the layout, MFU and verdicts
    row = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}").get(summary.ledger_id)
    assert row.run_id == summary.run_id and row.status == "succeeded" and row.verified
    assert row.measured_mfu == pytest.approx(summary.mfu)
    floor = {v.name: v for v in row.verdicts}["mfu_floor"]  # the demo gates MFU against the measured CPU peak
    assert floor.label == "pass" and floor.threshold > 0 and floor.measured >= floor.threshold

    # track: each tracker's run id in the ledger row's figures and in the summary, nothing lost, every step's loss
    runs = tracker_runs(row.figures)
    assert runs == {t.tracker: t.run_id for t in summary.trackers} and {"wandb", "tensorboard"} <= set(runs)
    assert all(f.value == 0 for f in row.figures if f.name.startswith("track/"))  # no row any tracker never got
    losses = {m.step: m.loss for m in metrics}
    assert tensorboard_scalars(run_dir / "tensorboard", "train/loss") == pytest.approx(losses, rel=1e-6)
    assert {s: h["loss"] for s, h in wandb_history(run_dir).items() if "loss" in h} == pytest.approx(losses, rel=1e-6)
    if "mlflow" in runs:  # always in CI (tests/support/trackers.flow_tracking)
        assert mlflow_history(mlflow_uri(), runs["mlflow"], "loss") == pytest.approx(losses, rel=1e-6)
        assert mlflow_get(mlflow_uri(), "runs/get", run_id=runs["mlflow"])["run"]["info"]["status"] == "FINISHED"
    files = [p for p in tmp_path.rglob("*") if p.is_file()]  # the run folder, its logs, the ledger, the shards
    assert len(files) > 20 and not [str(p) for p in files if TOKEN.encode() in p.read_bytes()]

    # artifacts: summary table, plan table and a PNG loss curve
    keys = {a.key for a in artifacts_of(state.state_details.flow_run_id)}
    assert {"run-summary", "plan", "loss-curve"} <= keys, keys
    assert (run_dir / "loss.png").stat().st_size > 1000


def test_cli_run_exit_code_on_bad_spec(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndataset: {path: /nope}\ntrain: {backend: nope}\n")
    r = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1
    assert "train.backend" in r.stderr and "dataset.path" in r.stderr


def test_a_crash_after_training_still_closes_the_ledger_row(prefect_backend, tmp_path):
    """A corrupt golden-curve file makes validation raise: the flow fails naming file:line, and the ledger row is
    closed as failed with that reason (never left `running`)."""
    from flows.pipeline import training_pipeline
    from nightloom.ledger import Ledger

    golden = tmp_path / "golden.jsonl"
    golden.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": \n')
    data = demo_data(tmp_path, steps=4, checkpoint_every=0)
    data["cluster"].update({"nodes": 1, "gpus_per_node": 2})  # the crash is under test, not the layout
    data["validate"] = {"golden": {"path": str(golden)}}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    state = training_pipeline(str(spec), return_state=True)
    assert state.is_failed() and "golden.jsonl:2" in state.message, state.message
    (row,) = Ledger(data["ledger"]["url"]).list_runs()
    assert row.status == "failed" and "golden.jsonl:2" in row.reason


#: the input kinds the default Prefect UI (3.9.1) renders on a task run page; it throws `Invalid TaskInputResponse`
#: on any other (a sub-flow's result, `flow_run`) and shows the page blank (its mapper in server/ui/assets/index-*.js)
UI_INPUT_KINDS = {"constant", "parameter", "task_run"}


def test_every_task_input_renders_in_the_ui(demo_run):
    """Every task run of the demo pipeline run (and of its shard sub-flow) has only inputs the default UI renders;
    the Run form has no test-only field."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    from flows.pipeline import training_pipeline

    assert set(training_pipeline.parameters.properties) == {"spec", "resume_run_id"}
    _, state = demo_run
    assert state.is_completed(), state.message
    root = state.state_details.flow_run_id
    with get_client(sync_client=True) as c:
        children = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[root]))
        )
        ids = [root, *(r.id for r in children)]
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
    assert len(children) == 1 and {r.name.split("-")[0] for r in runs} >= {"train", "validate", "record"}, runs
    bad = {
        (r.name, arg, i.input_type)
        for r in runs
        for arg, inputs in r.task_inputs.items()
        for i in inputs
        if i.input_type not in UI_INPUT_KINDS
    }
    assert not bad, bad
