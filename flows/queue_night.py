"""The nightly-queue flow: one night of a night queue. The `nightly-queue` deployment starts it at the window's start
(prefect.yaml); it plans what is left of the queue's jobs from now, runs tonight's stretches, one training-pipeline
subflow per job on its nodes, and records in the ledger what each did.

Side by side: stretches on disjoint nodes run at once (Prefect tasks on the flow's thread pool, each running its
job's pipeline as a subflow); a stretch whose nodes an earlier stretch of tonight holds waits for it to end. Each
pipeline's window gate reads the flow's clock (`at`, or now), so a test can run night 1 and night 2 at any real
time. A split job resumes its run (same run id, folder and ledger row) the next night, as split runs do; a job whose
night failed, crashed or was preempted keeps the steps it had and is planned again from the next night. Outside
every window the flow runs nothing and names the next night (the cron starts it then); with no such queue in the
ledger it logs so and completes. Each pipeline runs placed (flows/stages.placed): its cluster lock keyed by its
cluster name and node indices, its training stopped at its stretch's end, on Slurm pinned to its nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.pipeline import training_pipeline
from flows.stages import clock_at, placed
from nightloom.ledger import Ledger
from nightloom.queue.jobs import QueuedJob
from nightloom.queue.store import QueueRun
from nightloom.queue.tonight import JobProgress, NightStretch, night_outcome
from nightloom.records import Record
from nightloom.schedule.windows import parse_zoned
from nightloom.spec import LedgerSpec, RunSpec
from nightloom.spec.load import coerce_spec
from tasks.queue import (
    QueueNight,
    gantt_task,
    load_night_task,
    night_table_task,
    placement_task,
    record_run_task,
)


class QueueNightReport(Record):
    """What the flow did: the night it ran (or the next one, outside every window), each job's run, the chart."""

    queue: str
    at: datetime
    night_start: datetime | None = None
    next_night: datetime | None = None
    runs: list[QueueRun] = []
    gantt: str | None = None


@flow(name="nightly-queue", log_prints=True)
def nightly_queue(
    queue: str, ledger: str | None = None, at: str | None = None, folder: str | None = None
) -> QueueNightReport:
    """Run tonight's stretches of `queue` (in the ledger `ledger`, default $NIGHTLOOM_LEDGER_URL or the embedded
    one) as planned at `at` (ISO time with offset; default now). The Gantt chart goes to `folder` (default:
    the first job's storage.root/queues/QUEUE/NIGHT) and to the `queue-gantt` artifact."""
    url = ledger or os.environ.get("NIGHTLOOM_LEDGER_URL") or LedgerSpec().url
    when = parse_zoned(at, "nightly_queue: at") or datetime.now(UTC)
    night = load_night_task(url, queue, when)
    report = QueueNightReport(queue=queue, at=when)
    if night is None:  # no such queue (yet): a scheduled start before anyone created it is not a failure
        return report
    if night.plan is not None:
        report.gantt = str(gantt_task(night.plan, _chart_path(night, folder), f"queue {queue}"))
    if night.window is None:
        report.next_night = night.next_window.start if night.next_window else None
        return report
    report.night_start = night.window.start
    futures = {}
    for s in night.stretches:
        waits = [futures[j] for j in s.after if j in futures]
        futures[s.job_id] = job_night_task.submit(
            url, queue, night.jobs[s.job_id], s, night.progress.get(s.job_id), when, night.window.start, wait_for=waits
        )
    report.runs = [f.result() for f in futures.values()]
    night_table_task(report.runs, {j: job.name for j, job in night.jobs.items()})
    return report


def _chart_path(night: QueueNight, folder: str | None) -> Path:
    """Where the night's Gantt chart goes: `folder`, else the first job's storage root under queues/QUEUE/NIGHT."""
    win = night.window or night.next_window
    tz = ZoneInfo(night.queue.schedule.timezone) if night.queue.schedule else UTC
    stamp = (win.start if win else night.at).astimezone(tz).strftime("%Y%m%d-%H%M")
    if folder:
        return Path(folder) / f"gantt-{stamp}.png"
    first = min(night.jobs.values(), key=lambda j: j.id)
    root = Path(RunSpec.model_validate(first.spec).storage.root)  # the schema only: its files may be gone tonight
    return root / "queues" / night.queue.name / stamp / "gantt.png"


@task(name="queue-job-night", cache_policy=NO_CACHE)
def job_night_task(
    url: str,
    queue: str,
    job: QueuedJob,
    stretch: NightStretch,
    progress: JobProgress | None,
    at: datetime,
    night_start: datetime,
) -> QueueRun:
    """Run one job's stretch tonight as a training-pipeline subflow (resuming its run when it has one) on the
    flow's clock, placed on its nodes (lock key, stop at the stretch's end, Slurm node list), and record what it
    did; a failed or crashed night (its spec no longer valid too: a file it names is gone) is recorded, never
    raised."""
    before = progress or JobProgress(job.id)
    started = datetime.now(UTC)
    try:
        spec = coerce_spec(job.spec)
    except Exception as e:  # noqa: BLE001 - the night fails; the job is planned again
        night = _Night("failed", before.run_id, None, before.steps_done, f"{type(e).__name__}: {e}"[:1500], 0.0)
        return _record(url, queue, job, stretch, night_start, started, night)
    where = placement_task(spec, stretch)
    with clock_at(at), placed(where):
        state = training_pipeline(spec, resume_run_id=before.run_id, return_state=True)
    fr_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
    result = state.result(raise_on_failure=False)
    if state.is_completed() and not isinstance(result, BaseException):
        train_s = sum(st.seconds for st in result.stages if st.stage == "train")
        steps = result.steps or before.steps_done
        night = _Night(result.status, result.run_id, fr_id, steps, result.reason, train_s)
    else:
        status = "crashed" if state.is_crashed() else "failed"
        reason = f"{state.type.value}: {state.message or result}"[:1500]
        night = _Night(status, before.run_id or _run_of(url, fr_id), fr_id, before.steps_done, reason, 0.0)
    return _record(url, queue, job, stretch, night_start, started, night)


@dataclass(frozen=True)
class _Night:
    """What one job's pipeline did tonight, before the queue judges it."""

    status: str
    run_id: str | None
    flow_run_id: str | None
    steps: int
    reason: str
    train_s: float


def _record(
    url: str, queue: str, job: QueuedJob, stretch: NightStretch, night_start: datetime, started: datetime, n: _Night
) -> QueueRun:
    """Judge the night (night_outcome), log it and record it in the ledger's queue."""
    out = night_outcome(n.status, n.steps, job.steps)
    get_run_logger().info("job %d (%s): %s; %s", job.id, job.name, n.status, out.reason)
    run = QueueRun(
        queue=queue,
        job_id=job.id,
        night=night_start,
        segment_start=stretch.start,
        segment_end=stretch.end,
        nodes=list(stretch.nodes),
        run_id=n.run_id,
        flow_run_id=n.flow_run_id,
        status=n.status,
        job_status=out.status,
        steps_done=n.steps,
        hours_trained=n.train_s / 3600.0,
        reason=f"{n.reason}; {out.reason}"[:2000],
        started_at=started,
        finished_at=datetime.now(UTC),
    )
    return record_run_task(url, run)


def _run_of(url: str, flow_run_id: str | None) -> str | None:
    """The pipeline run a failed subflow opened (its run id ends with its flow run's id), if it got that far."""
    if not flow_run_id:
        return None
    with Ledger(url) as lg:
        rows = [r for r in lg.list_runs() if r.run_id.endswith(flow_run_id[:8])]
    return rows[0].run_id if rows else None
