"""The queue's one job record (QueuedJob: the figures a job is planned from and its place in a queue), the figures
a spec gives, and the rules that refuse a job before it enters a queue.

The figures come from nightloom.schedule.inputs (the same sources `nightloom cost` uses): the step time from
--hours, else the ledger's measurement, else the planner. A queue takes its time zone, windows and currency from its
first job (stored with the queue, cleared when its last job leaves): a later job whose time zone, windows or
currency differ is refused, as is one with more nodes than the queue, or policy run-now (a queue runs in windows).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from nightloom.records import FrozenRecord
from nightloom.schedule.inputs import inputs_for_spec, step_time_unknown
from nightloom.schedule.windows import aware_utc
from nightloom.spec import RunSpec, ScheduleSpec
from nightloom.wording import plural

if TYPE_CHECKING:
    from nightloom.ledger import RunRecord

FAR = datetime.max.replace(tzinfo=ZoneInfo("UTC"))  # sorts a job without a deadline after every dated one


class QueueRefused(ValueError):
    """A job the queue refuses; the message names every reason, and the queue is left unchanged."""


class QueuedJob(FrozenRecord):
    """One job of a night queue, the one record the store keeps, the plan packs and a night runs: the figures it is
    planned from (as job_figures found them when it was added) and its place in the queue (id 0 and queue "" until
    the store adds it). Its price and discount are its own schedule's; its windows and zone are the queue's."""

    name: str
    spec_hash: str
    nodes: int
    gpus: int
    policy: str  # wait or split (add refuses run-now)
    steps: int
    step_time_s: float
    hours_source: str
    provisioning_s: float
    checkpoint_s: float
    restore_s: float
    schedule: ScheduleSpec
    id: int = 0
    queue: str = ""
    status: str = "queued"
    priority: int = 1
    deadline: datetime | None = None
    added_at: datetime | None = None
    spec: dict[str, Any] = {}
    spec_path: str | None = None

    @property
    def training_s(self) -> float:
        return self.steps * self.step_time_s

    @property
    def hours(self) -> float:
        return self.training_s / 3600.0

    def order(self) -> tuple:
        """Placement order: priority 1 first, then the earliest deadline, then the order added (id)."""
        return (self.priority, aware_utc(self.deadline) if self.deadline else FAR, self.id)


def job_figures(
    spec: RunSpec,
    *,
    hours: float | None = None,
    runs: Sequence[RunRecord] = (),
    planner_step_s: float | None = None,
    planner_detail: str = "",
) -> QueuedJob:
    """The job a spec makes, not yet in a queue: `hours` (given) > the ledger's measured rate in `runs` > the
    planner's step time. StepTimeUnknown (a ScheduleError) when no source gives a step time."""
    inp = inputs_for_spec(spec, planner_step_s=planner_step_s, planner_detail=planner_detail, runs=runs, hours=hours)
    if inp.step_time_s is None:
        raise step_time_unknown(spec)
    return QueuedJob(
        name=spec.name,
        spec_hash=spec.spec_hash(),
        nodes=spec.cluster.nodes,
        gpus=spec.world_size,
        policy=spec.schedule.policy,
        steps=inp.steps,
        step_time_s=inp.step_time_s,
        hours_source=inp.step_source,
        provisioning_s=inp.provisioning_s,
        checkpoint_s=inp.checkpoint_s,
        restore_s=inp.restore_s,
        schedule=spec.schedule,
    )


def _windows_text(s: ScheduleSpec) -> str:
    return ", ".join(f"{w.start}–{w.end}" for w in s.windows) or "none"


def _window_set(s: ScheduleSpec) -> list[tuple[str, str]]:
    return sorted((w.start, w.end) for w in s.windows)


def refusals(job: QueuedJob, *, max_nodes: int, queue_schedule: ScheduleSpec | None) -> list[str]:
    """Every reason the queue refuses `job` (empty: accepted). `queue_schedule`: the queue's, None while empty."""
    return spec_refusals(job.nodes, job.policy, job.schedule, max_nodes=max_nodes, queue_schedule=queue_schedule)


def spec_refusals(
    nodes: int, policy: str, schedule: ScheduleSpec, *, max_nodes: int, queue_schedule: ScheduleSpec | None
) -> list[str]:
    """Every reason the queue refuses a job of `nodes` nodes on `schedule` (its policy, windows, zone, currency):
    all from the spec, so they are checked before the job's hours are looked for (`--hours` would not help)."""
    out = []
    if nodes > max_nodes:
        out.append(f"cluster.nodes: the job needs {plural(nodes, 'node')}; the queue has {max_nodes}")
    if policy not in ("wait", "split"):
        out.append(
            f"schedule.policy: {policy!r}: a queue runs its jobs inside its windows; give wait (one window) "
            "or split (across nights); deployments/queue-demo.yaml is an example"
        )
    if not schedule.windows:
        out.append("schedule.windows: empty: a queue runs its jobs inside windows")
    if queue_schedule is not None:
        s, q = schedule, queue_schedule
        if s.timezone != q.timezone:
            out.append(f"schedule.timezone: {s.timezone!r} contradicts the queue's {q.timezone!r}")
        if _window_set(s) != _window_set(q):
            out.append(f"schedule.windows: {_windows_text(s)} contradict the queue's {_windows_text(q)}")
        if s.currency != q.currency:
            out.append(f"schedule.currency: {s.currency!r} differs from the queue's {q.currency!r}")
    return out
