"""Record tasks: the ledger row (opened before training, closed after) and the run-summary artifact."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from nightloom.ledger import Ledger, LedgerError
from nightloom.ledger.model import ledger_fields
from nightloom.parallel import ParallelPlan
from nightloom.report import RunSummary, StageTime, summary_rows, wrapped_rows
from nightloom.runfiles import RunFiles
from nightloom.spec import RunSpec
from nightloom.track.records import TrackerStatus, TrackingFile, tracker_figures
from tasks.track import secrets_in_env


@task(name="ledger-open", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def start_record_task(spec: RunSpec, run_id: str, plan: ParallelPlan | None, resume: bool) -> str:
    """Open (or, when resuming, re-open) the run's ledger row; return its key."""
    with Ledger(spec.ledger.url) as ledger:
        if resume:
            try:
                ledger.get(run_id)
                ledger.update_run(run_id, status="running")
                get_run_logger().info("re-opened ledger row %s (running)", run_id)
                return run_id
            except LedgerError:
                pass
        ledger.start_run(run_id=run_id, plan=plan, **ledger_fields(spec))  # the model the run trains, not model.name
    get_run_logger().info(
        "opened ledger row %s (running; spec hash %s, %d rank(s) requested)", run_id, spec.spec_hash(), spec.world_size
    )
    return run_id


@task(name="ledger-fail", cache_policy=NO_CACHE)
def fail_record_task(spec: RunSpec, run_id: str, status: str, reason: str, duration_s: float) -> None:
    """Close the row of a run that did not complete (failed, cancelled, refused), with the reason."""
    trackers = track_failed(spec, run_id, status, reason)  # track: the runs training opened end FAILED
    with Ledger(spec.ledger.url) as ledger:
        ledger.finish_run(
            run_id,
            status=status,
            reason=reason[:2000],
            duration_s=duration_s,
            figures=tracker_figures(trackers) or None,
        )
    get_run_logger().info("closed ledger row %s: %s after %.1f s (%s)", run_id, status, duration_s, reason[:200])


def track_failed(spec: RunSpec, run_id: str, status: str, reason: str) -> list[TrackerStatus]:
    """The tracker runs a failed run's training opened (tracking.json), ended FAILED with the reason; never raises."""
    run_dir = Path(spec.storage.root) / run_id
    if not spec.track.enabled() or not TrackingFile.load(run_dir).runs:
        return []
    from nightloom.track.finish import RunEnd, finish_trackers

    summary = {"run_id": run_id, "status": status, "reason": reason[:500]}
    with secrets_in_env(spec.track):
        return finish_trackers(
            RunEnd(spec=spec, run_id=run_id, run_dir=run_dir, plan=None, succeeded=False, summary=summary)
        )


def track_end(spec: RunSpec, summary: RunSummary, plan: ParallelPlan, outcome, status: str) -> list[TrackerStatus]:
    """The run's trackers finished (nightloom.track.finish): params, verdicts, plots, summary; never raises."""
    if not spec.track.enabled():
        return []
    from nightloom.track.finish import RunEnd, finish_trackers

    end = RunEnd(
        spec=spec,
        run_id=summary.run_id,
        run_dir=Path(summary.run_dir),
        plan=plan,
        succeeded=status == "succeeded",
        summary=summary.model_dump(mode="json") | {"steps": outcome.steps, "last_loss": outcome.last_loss},
        verdicts=list(outcome.verdicts),
        figures=list(outcome.figures),
        export_dir=summary.export_dir,
    )
    with secrets_in_env(spec.track):  # a Secret block's token, for this end-of-run logging only
        return finish_trackers(end)


@task(name="record", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def record_task(
    spec: RunSpec,
    summary: RunSummary,
    plan: ParallelPlan,
    cluster,
    outcome,
    cost: float,
    stages: list[StageTime],
    status: str,
) -> RunSummary:
    """Close the ledger row with the measured figures and verdicts; publish the run-summary table."""
    log = get_run_logger()
    duration = sum(s.seconds for s in stages)
    trackers = track_end(spec, summary, plan, outcome, status)  # track: runs finished, their ids, what was lost
    for t in trackers:
        (log.warning if t.lost or t.error else log.info)("tracker %s", t.note())
    with Ledger(spec.ledger.url) as ledger:
        ledger.update_run(
            summary.run_id,
            plan=plan,
            world_size=cluster.world_size,
            time_to_ready_s=cluster.time_to_ready_s,
            metrics_path=str(RunFiles(summary.run_dir).metrics),
        )
        ledger.finish_run(
            summary.run_id,
            status=status,
            measured_mfu=outcome.mfu,
            hfu=outcome.hfu,
            tokens_per_s=outcome.tokens_per_s,
            final_loss=outcome.last_loss,
            duration_s=duration,
            cost=cost,
            verdicts=outcome.verdicts,
            precision=outcome.precision,
            peak_source=outcome.peak_source,
            reason=summary.reason or None,
            figures=[*outcome.figures, *tracker_figures(trackers)] or None,
        )
    summary = summary.model_copy(
        update=dict(
            first_loss=outcome.first_loss,
            last_loss=outcome.last_loss,
            steps=outcome.steps,
            tokens_per_s=outcome.tokens_per_s,
            mfu=outcome.mfu,
            peak_source=outcome.peak_source or "",
            cost=cost,
            currency=spec.schedule.currency,
            ledger_id=summary.run_id,
            stages=stages,
            verdicts=list(outcome.verdicts),
            figures=list(outcome.figures),
            trackers=trackers,
        )
    )
    rows = summary_rows(summary, outcome.verdicts, cluster.time_to_ready_s, cost, spec.schedule.currency, stages)
    create_table_artifact(key="run-summary", table=wrapped_rows(rows), description=f"nightloom run {summary.run_id}")
    log.info("recorded run %s in the ledger (%s)", summary.run_id, status)
    return summary
