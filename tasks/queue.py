"""The night queue's tasks: read tonight's plan from the ledger, publish its Gantt chart, record what a job's night
did. The decisions (what is left of a job, which stretches are tonight's, what a night makes of a job) are
nightloom.queue.tonight's.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from sqlalchemy.engine import make_url

from nightloom.ledger import Ledger
from nightloom.queue.jobs import QueuedJob
from nightloom.queue.store import QueueRecord, QueueRun, QueueStore
from nightloom.queue.timetable import QueuePlan, plan_queue
from nightloom.queue.tonight import (
    JobProgress,
    NightStretch,
    StretchPlacement,
    next_night,
    placement,
    tonight,
    tonight_window,
)
from nightloom.schedule.windows import Interval
from nightloom.spec import RunSpec


@dataclass(frozen=True)
class QueueNight:
    """Tonight for one queue: its record and jobs, each job's progress, the plan from `at`, tonight's window (None
    outside every window) and the stretches that start in it, or the next window when outside."""

    queue: QueueRecord
    jobs: dict[int, QueuedJob]
    progress: dict[int, JobProgress]
    at: datetime
    plan: QueuePlan | None
    window: Interval | None
    next_window: Interval | None
    stretches: list[NightStretch] = field(default_factory=list)


@task(name="queue-tonight", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def load_night_task(ledger_url: str, queue: str, at: datetime) -> QueueNight | None:
    """Read the queue and what its nights did, plan what is left from `at` and pick tonight's stretches; None (and
    a log line) when the ledger has no such queue: a deployment's schedule may start before anyone made it."""
    with Ledger(ledger_url) as lg:
        store = QueueStore(lg)
        if queue not in store.names():
            where = make_url(ledger_url).render_as_string(hide_password=True)
            get_run_logger().info("no queue named %s in %s; nothing to run", queue, where)
            return None
        q, jobs, progress, left = store.get(queue), store.jobs(queue), store.progress(queue), store.plan_jobs(queue)
    plan = None
    if q.schedule is not None and left:
        plan = plan_queue(q.schedule, q.max_nodes, left, at, q.budget_per_night)
    window = tonight_window(q.schedule, at) if q.schedule is not None else None
    nxt = next_night(q.schedule, at) if q.schedule is not None and window is None else None
    night = QueueNight(q, {j.id: j for j in jobs}, progress, at, plan, window, nxt)
    if plan is not None and window is not None:
        night = QueueNight(q, night.jobs, progress, at, plan, window, None, tonight(plan, window))
    log = get_run_logger()
    if window is None:
        log.info("queue %s at %s: outside every window; the next night starts %s", queue, at.isoformat(), nxt)
    else:
        names = [f"{jobs_name(night, s.job_id)} on nodes {list(s.nodes)}" for s in night.stretches]
        log.info("queue %s, night of %s: %s", queue, window.start.isoformat(), "; ".join(names) or "nothing to run")
    return night


def jobs_name(night: QueueNight, job_id: int) -> str:
    job = night.jobs.get(job_id)
    return f"job {job_id} ({job.name})" if job else f"job {job_id}"


@task(name="queue-placement", cache_policy=NO_CACHE)
def placement_task(spec: RunSpec, stretch: NightStretch) -> StretchPlacement:
    """Place a stretch (lock key, stop time, Slurm node pinning: the partition's nodes read with scontrol) and log
    how."""
    names = partition_nodes(spec.cluster.provider.partition) if spec.cluster.provider.kind == "slurm" else None
    p = placement(spec, stretch, names)
    stop = p.stop_at.isoformat() if p.stop_at else "the gate's deadline (the window's end)"
    get_run_logger().info(
        "job %d on nodes %s: lock %s, training stops at %s; %s",
        stretch.job_id,
        list(stretch.nodes),
        p.lock_key,
        stop,
        p.note,
    )
    return p


def partition_nodes(partition: str) -> list[str] | None:
    """A Slurm partition's node names in its own order (`scontrol show partition`, then `show hostnames`), or None
    when Slurm does not answer (the queue then takes any nodes of it)."""
    import subprocess

    from nightloom.provision.base import ProvisionError
    from nightloom.provision.slurm import run_cmd

    try:
        r = run_cmd(["scontrol", "show", "partition", "-o", partition], timeout=30)
        fields = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv) if r.returncode == 0 else {}
        if not fields.get("Nodes") or fields["Nodes"] == "(null)":
            return None
        h = run_cmd(["scontrol", "show", "hostnames", fields["Nodes"]], timeout=30)
    except (ProvisionError, OSError, ValueError, subprocess.TimeoutExpired) as e:
        get_run_logger().info("slurm partition %s: nodes not read (%s)", partition, type(e).__name__)
        return None
    names = h.stdout.split() if h.returncode == 0 else []
    return names or None


@task(name="queue-gantt", cache_policy=NO_CACHE)
def gantt_task(plan: QueuePlan, path: Path, title: str) -> Path:
    """Draw the plan's Gantt chart to `path` and publish it as the `queue-gantt` artifact (the PNG inline, and
    its path)."""
    from prefect.artifacts import create_markdown_artifact

    from nightloom.queue.gantt import plot_queue_gantt

    path.parent.mkdir(parents=True, exist_ok=True)
    out = plot_queue_gantt(plan, path, title=title)
    try:
        png = base64.b64encode(out.read_bytes()).decode()
        md = f"### {title}\n\n![Gantt chart](data:image/png;base64,{png})\n\nSaved at `{out}`"
        create_markdown_artifact(key="queue-gantt", markdown=md, description=f"{title}: the plan of nights")
    except Exception as e:  # noqa: BLE001 - an artifact never fails the night
        get_run_logger().warning("could not write the queue-gantt artifact: %s", type(e).__name__)
    return out


@task(name="queue-record-night", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def record_run_task(ledger_url: str, run: QueueRun) -> QueueRun:
    """Record what one job's night did; the job's status follows."""
    with Ledger(ledger_url) as lg:
        rec = QueueStore(lg).record_run(run)
    get_run_logger().info(
        "queue %s job %d: run %s %s, %d steps, %.4f h trained; job %s (%s)",
        run.queue,
        run.job_id,
        run.run_id,
        run.status,
        run.steps_done,
        run.hours_trained,
        run.job_status,
        run.reason,
    )
    return rec


@task(name="queue-summary", cache_policy=NO_CACHE)
def night_table_task(runs: list[QueueRun], names: dict[int, str]) -> None:
    """Tonight's runs as the `queue-night` table artifact."""
    from prefect.artifacts import create_table_artifact

    rows = [
        {
            "job": f"{r.job_id} {names.get(r.job_id, '')}",
            "run": r.run_id or "",
            "status": r.status,
            "job status": r.job_status,
            "steps done": r.steps_done,
            "hours trained": round(r.hours_trained, 4),
            "nodes": ",".join(map(str, r.nodes)),
        }
        for r in runs
    ]
    try:
        create_table_artifact(key="queue-night", table=rows, description="What the queue ran tonight")
    except Exception as e:  # noqa: BLE001
        get_run_logger().warning("could not write the queue-night artifact: %s", type(e).__name__)
