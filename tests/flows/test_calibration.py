"""The ledger calibrates the planner in a real run: the pipeline's plan task reads the measured/predicted MFU of
the spec's verified runs (written by the record task), and the next plan moves toward the measurement, bounded."""

from __future__ import annotations

import pytest

from nightloom.spec import RunSpec


def _spec(tmp_path, ledger: str = "ledger.db") -> RunSpec:
    return RunSpec(
        name="cal",
        model={"name": "llama2-7b"},
        dataset={"path": str(tmp_path)},
        cluster={"provider": "slurm", "name": "c", "nodes": 1, "gpus_per_node": 8, "gpu_type": "h100-80gb"},
        train={"seq_len": 4096, "global_batch": 64, "steps": 10},
        ledger={"url": f"sqlite:///{tmp_path / ledger}"},
    )


def _record(spec: RunSpec, plan, run_id: str, measured_step_s: float, *, gated: bool = True) -> None:
    """What the pipeline writes for a run: the ledger-open and record tasks, with the measured figures."""
    from nightloom.gates import Verdict
    from nightloom.provision.base import Cluster, Node
    from nightloom.report import RunSummary
    from tasks.record import record_task, start_record_task
    from tasks.validate import ValidationOutcome

    measured_mfu = plan.mfu * plan.step_time_s / measured_step_s  # same work per step, at the measured time
    start_record_task(spec, run_id, plan, resume=False)
    verdicts = [
        Verdict(name="mfu_floor", passed=True, skipped=not gated, measured=measured_mfu, reason="test"),
        Verdict(name="loss_drop", passed=True, skipped=not gated, measured=0.2, reason="test"),
    ]
    outcome = ValidationOutcome(verdicts=verdicts, first_loss=3.0, last_loss=2.0, steps=10, mfu=measured_mfu)
    cluster = Cluster(
        provider="slurm", name="c", nodes=[Node(name="n0", address="a", slots=8)], master_addr="a", master_port=1
    )
    summary = RunSummary(
        run_id=run_id, name=spec.name, status="completed", run_dir="/tmp/x", layout=plan.layout(), shard_imbalance=0.0
    )
    record_task(spec, summary, plan, cluster, outcome, 0.0, [], "succeeded")


def test_next_plan_moves_toward_the_measured_step_time_within_bounds(prefect_backend, tmp_path):
    from nightloom.planner.steptime import CALIBRATION_BOUNDS, DEFAULT_EFFICIENCY
    from tasks.plan import plan_task

    spec = _spec(tmp_path)
    first = plan_task(spec, 8)
    assert first.step_time_s and first.mfu
    assert not any("calibrated" in x for x in first.explanation)

    # a run that proves nothing (every gate skipped) does not calibrate
    _record(spec, first, "unverified", first.step_time_s * 1.25, gated=False)
    assert plan_task(spec, 8).step_time_s == pytest.approx(first.step_time_s)

    # a verified run measured 25% slower than predicted: the next plan predicts slower, but not past the measurement
    _record(spec, first, "slow", first.step_time_s * 1.25)
    second = plan_task(spec, 8)
    assert any("calibrated from the ledger" in x for x in second.explanation), second.explanation
    # only the compute part slows down (by at most 1/0.8), so every layout's step lies in (t, 1.25·t]
    assert first.step_time_s < second.step_time_s <= first.step_time_s * 1.25 * (1 + 1e-9)
    assert first.mfu * 0.8 * (1 - 1e-9) <= second.mfu < first.mfu

    # a run 10× slower than predicted moves the efficiency only to its lower bound
    spec2 = _spec(tmp_path, "ledger2.db")
    _record(spec2, first, "very-slow", first.step_time_s * 10)
    bounded = plan_task(spec2, 8)
    eff = DEFAULT_EFFICIENCY * CALIBRATION_BOUNDS[0]
    assert any(x.endswith(f"= {eff:.2f}") for x in bounded.explanation), bounded.explanation
    assert bounded.mfu > first.mfu / 10  # it did not follow the measurement all the way
