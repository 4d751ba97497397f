"""The whole run as one Prefect flow: shard → gate → provision → plan → train → validate → record.

Teardown of the cluster is guaranteed: `rented_cluster` releases it on the way out of the block for failures
inside the flow, and state hooks (which read the run's teardown record from disk) for crashes and
cancellations from the UI. The stages are in flows/stages.py; the status rule in nightloom/report.py.
"""

from __future__ import annotations

from prefect import flow

from flows.stages import (
    Stopwatch,
    benchmark_stage,
    continue_in_next_window,
    failure_recorded,
    gate_stage,
    ledger_row,
    make_run_id,
    model_shape,
    night_stage,
    rented_cluster,
    run_folder,
    shard_stage,
    train_stage,
    validate_stage,
)
from flows.ui_schema import OptionalRunId, RunSpecForm
from nightloom.gates import ValidationFailed
from nightloom.report import RunSummary, run_status
from nightloom.spec.load import coerce_spec
from nightloom.train.job import TrainJob
from tasks.plan import plan_task
from tasks.record import record_task
from tasks.teardown import teardown_hook


@flow(name="training-pipeline", log_prints=True, on_cancellation=[teardown_hook], on_crashed=[teardown_hook])
def training_pipeline(spec: RunSpecForm | str, resume_run_id: OptionalRunId = None) -> RunSummary:
    """Run one spec end to end.

    Args:
        spec: The run spec: the form (RunSpec), or the path of a spec YAML file from the repository root.
        resume_run_id: A split or interrupted run to continue in its folder (checkpoints, metrics, ledger
            row); unset for a new run.
    """
    spec, watch, resume = coerce_spec(spec), Stopwatch(), resume_run_id is not None
    run_id = resume_run_id or make_run_id(spec)
    run_dir = run_folder(spec, run_id)
    summary = RunSummary(run_id=run_id, name=spec.name, status="failed", run_dir=str(run_dir))
    with failure_recorded(spec, run_id, resume, watch):  # no ledger row yet: a failure here still gets one
        with watch.stage("shard"):
            summary.add_shards(shard_stage(spec))
        shape = model_shape(spec)
    with watch.stage("gate"):
        pre_plan, gate = gate_stage(spec, shape, run_id, resume)
    if not gate.run_now:
        return summary.not_run(gate.status, gate.reason, gate.next_run_at, watch.stages)
    with ledger_row(spec, run_id, pre_plan, resume, watch) as summary.ledger_id:
        with rented_cluster(spec, run_dir, watch) as rental:
            with watch.stage("plan"):
                plan = plan_task(spec, rental.cluster.world_size)
            job = TrainJob.for_run(
                spec,
                run_id,
                run_dir,
                shape,
                plan,
                deadline_unix=gate.deadline_unix,
                stop_after_steps=gate.stop_after_steps,
            )
            with watch.stage("train"):
                trained = train_stage(spec, rental, job)
            bench = benchmark_stage(spec, run_dir, trained.result, rental, watch)  # lm-eval on its nodes: base vs tuned
        summary.add_training(trained, plan.mfu)
        outcome = validate_stage(spec, run_dir, trained, shape, bench, watch)  # every gate, the benchmarks' too
        status = run_status(outcome.passed, trained.result, gate.deadline_kind)
        summary.status, summary.reason = status.summary, status.reason
        nights = night_stage(spec, run_id, gate, rental, trained)  # this night's cost, recorded; nights left
        summary.add_nights(nights.nights_used, nights.nights_left, nights.predicted_finish)
        with watch.stage("record"):
            summary = record_task(
                spec, summary, trained.plan, trained.cluster, outcome, nights.run_cost, watch.stages, status.ledger
            )
    if not outcome.passed:
        raise ValidationFailed([v for v in outcome.verdicts if not v.passed])
    if summary.status == "split":
        summary.next_run_at, nxt = continue_in_next_window(spec, run_id)
        summary.reason += f"; continues at {summary.next_run_at}" + (f" (flow run {nxt})" if nxt else "")
    return summary
