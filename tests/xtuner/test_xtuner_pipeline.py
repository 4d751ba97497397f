"""`training_pipeline` with train.backend: xtuner runs every stage: shard → provision → plan → train → validate → record.

It runs the shipped demo (deployments/xtuner-lora-demo.yaml), its paths moved into the test's folder: the demo's
own loss gate must pass, its model land where a native run's does, and its MFU and memory figures be measured as
a native run's are."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def demo_spec(tmp_path: Path, base_model: Path):
    """The shipped XTuner demo with its sample, shards, runs, ledger and base model in `tmp_path`."""
    from nightloom.spec.load import parse_spec

    data = yaml.safe_load((REPO / "deployments" / "xtuner-lora-demo.yaml").read_text())
    data["dataset"]["path"] = str(tmp_path / "alpaca.jsonl")  # sample: true builds it there
    data["sharding"]["output"] = str(tmp_path / "shards")
    data["train"]["xtuner"]["base_model"] = str(base_model)  # what build_tiny_base_model builds (same script)
    data["storage"] = {"root": str(tmp_path / "runs")}
    data["ledger"] = {"url": f"sqlite:///{tmp_path / 'ledger.db'}"}
    data["track"] = {"tensorboard": {}}  # track: XTuner's steps reach a tracker, its run in the summary and ledger
    return parse_spec(data)


def test_full_pipeline_with_xtuner_backend(prefect_backend, xtuner_env, base_model, tmp_path):
    from flows.pipeline import training_pipeline
    from nightloom.ledger import Ledger
    from nightloom.metrics import read_metrics
    from nightloom.perf import cpu_matmul_peak_source
    from nightloom.track.records import tracker_runs
    from tests.support.trackers import tensorboard_scalars

    spec = demo_spec(tmp_path, base_model)
    state = training_pipeline(spec, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.status == "completed" and summary.shards == 2 and summary.steps == spec.train.steps
    gate = next(v for v in summary.verdicts if v.name == "loss_drop")
    assert gate.passed and gate.threshold == spec.validate_.min_loss_drop >= 0.02, gate.reason  # a real gate
    run_dir = Path(summary.run_dir)
    steps = read_metrics(run_dir / "metrics.jsonl")
    assert [m.step for m in steps] == list(range(1, spec.train.steps + 1))
    # the ranks' peak RSS, as the native trainer measures it: the process's since it started, never reset
    assert all(m.peak_mem_bytes and m.peak_mem_bytes > 100 * 2**20 for m in steps)
    assert summary.peak_source == cpu_matmul_peak_source()  # the native trainer's CPU peak: comparable MFU
    export = run_dir / "export"  # as a native run: the merged model, the adapter inside it
    assert (export / "config.json").is_file() and (export / "adapter" / "adapter_config.json").is_file()
    assert not (run_dir / "model").exists() and not (run_dir / "adapter").exists()
    (tracked,) = summary.trackers  # its row: the run and the rows it took (every step)
    assert tracked.note().endswith(f": {spec.train.steps} rows sent")
    assert summary.output_rows() == [
        ("export", str(export)),
        ("adapter", str(export / "adapter")),
        ("tensorboard", tracked.note()),
    ]
    row = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}").get(summary.ledger_id)
    assert row.status == "succeeded" and row.final_loss == summary.last_loss
    # track: the TensorBoard run in the ledger row's figures and the summary, every step's loss as metrics.jsonl's
    folder = str(run_dir / "tensorboard")
    assert tracker_runs(row.figures) == {"tensorboard": folder} == {t.tracker: t.run_id for t in summary.trackers}
    losses = tensorboard_scalars(run_dir / "tensorboard", "train/loss")
    assert losses == pytest.approx({m.step: m.loss for m in steps}, rel=1e-6)
