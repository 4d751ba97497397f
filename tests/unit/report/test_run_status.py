"""The run's status rule (nightloom.report.run_status), the run-folder names, the one precision rule and
TrainJob.for_run: the facts the pipeline flow used to compute inline."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nightloom.perf import Peak, PeakMeasurement, resolve_peak, resolve_precision
from nightloom.report import RunStatus, run_status
from nightloom.runfiles import RunFiles
from nightloom.train.job import TrainJob, TrainResult

ROOT = Path(__file__).resolve().parents[3]


def result(stopped: str = "completed", steps: int = 10) -> TrainResult:
    return TrainResult(
        steps_done=steps, total_steps=10, stopped=stopped, final_loss=1.0, tokens=1, wall_s=1.0, last_checkpoint="c/7"
    )


def test_run_status_rule():
    assert run_status(True, result(), None) == RunStatus("completed", "succeeded", "")
    assert run_status(False, result(), None) == RunStatus("failed", "failed", "")
    assert run_status(False, result("deadline", 7), "window") == RunStatus("failed", "failed", "")
    split = run_status(True, result("deadline", 7), "window")
    assert split == RunStatus("split", "stopped", "stopped at the window end after 7/10 steps (checkpoint c/7)")
    budget = run_status(True, result("deadline", 7), "budget")
    assert (budget.summary, budget.ledger) == ("stopped", "stopped") and "budget end after 7/10" in budget.reason
    assert run_status(True, result("stop_after_steps", 7), None).reason.startswith("stopped at the deadline end")


def test_run_files_are_named_in_one_place():
    f = RunFiles("/runs/r1")
    assert f.metrics == Path("/runs/r1/metrics.jsonl") and f.result == Path("/runs/r1/result.json")
    assert f.checkpoints == Path("/runs/r1/checkpoints") and f.job(2) == Path("/runs/r1/job-attempt2.json")
    assert f.cluster.name == "cluster.json" and f.processes.name == "processes.json" and f.pids.name == "pids"
    assert f.discarded_metrics.name == "metrics-discarded.jsonl" and f.rank_pid(3) == Path("/runs/r1/pids/rank-3.pid")


@pytest.mark.parametrize(
    "precision, device, want",
    [
        ("auto", "cpu", "fp32"),
        ("auto", "h100-80gb", "bf16"),
        ("auto", "cuda", "bf16"),
        ("bf16", "cpu", "bf16"),
        ("fp32", "a100-80gb", "fp32"),
    ],
)
def test_the_auto_precision_rule(precision, device, want):
    assert resolve_precision(precision, device) == want


def test_one_peak_record():
    assert PeakMeasurement is Peak
    p = resolve_peak("h100-80gb", "auto")
    assert p.precision == "bf16" and p.source.startswith("datasheet: ") and p.flops > 1e14


def demo_spec(tmp_path, **cluster):
    from nightloom.spec.load import load_spec

    data = yaml.safe_load((ROOT / "deployments" / "local-demo.yaml").read_text())
    data["dataset"]["path"] = str(ROOT / "datasets" / "sample" / "corpus.jsonl")
    data["cluster"].update(cluster)
    (p := tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    return load_spec(p)


def test_train_job_for_run(tmp_path):
    from nightloom.catalog import get_model
    from nightloom.parallel import ParallelPlan

    plan = ParallelPlan(dp_shard=4)
    spec = demo_spec(tmp_path)
    job = TrainJob.for_run(spec, "r1", tmp_path / "r1", get_model(spec.model.name), plan, deadline_unix=5.0)
    assert job.run_dir == str(tmp_path / "r1") and job.plan == plan and job.attempt == 0 and job.resume
    assert job.peak_flops is None and job.peak_source is None  # CPU: the trainer measures it
    assert job.deadline_unix == 5.0 and job.stop_after_steps is None and job.manifest == spec.sharding.output
    assert job.model.layers == get_model(spec.model.name).layers and job.train == spec.train
    gpu = demo_spec(tmp_path, gpu_type="h100-80gb")
    job = TrainJob.for_run(gpu, "r1", tmp_path, get_model(gpu.model.name), plan, stop_after_steps=3)
    assert (job.peak_flops, job.peak_source) == (
        resolve_peak("h100-80gb", gpu.train.precision).flops,
        resolve_peak("h100-80gb", gpu.train.precision).source,
    )
    assert job.stop_after_steps == 3 and job.metrics_path == tmp_path / "metrics.jsonl"
