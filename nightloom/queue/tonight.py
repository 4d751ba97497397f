"""One night of a night queue: what is left of each job, which stretches of the plan fall in tonight's window, and
what a night's outcome makes of a job (done, continues as a split, or planned again).

Pure: the nightly-queue flow (flows/queue_night.py) reads the queue and its runs from the ledger, asks these rules
and runs what they pick. A job that ran before is planned with the steps it has left (its progress), and its first
stretch pays a restore as well as the provisioning; a finished job leaves the plan; a failed, preempted or
deferred night leaves its steps to be planned again from the next night on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime

from nightloom.queue.jobs import QueuedJob
from nightloom.queue.timetable import QueuePlan
from nightloom.schedule.windows import Interval, aware_utc, current_window, next_window
from nightloom.spec import RunSpec, ScheduleSpec

#: the queue job statuses: queued (never ran, or planned again after a failed night), split (continues next night),
#: done (trained all its steps)
JOB_STATUSES = ("queued", "split", "done")


@dataclass(frozen=True)
class JobProgress:
    """What a job's nights did so far: its steps trained, the run (ledger row, run folder) a later night resumes,
    and the status the last night left it in."""

    job_id: int
    steps_done: int = 0
    run_id: str | None = None
    status: str = "queued"
    nights: int = 0


@dataclass(frozen=True)
class NightStretch:
    """One stretch of a job tonight: when, on which node indices, its steps, and the jobs whose stretches tonight
    must end first (they hold some of its nodes before it starts)."""

    job_id: int
    start: datetime
    end: datetime
    nodes: tuple[int, ...]
    training_s: float
    parts: tuple[str, ...]
    after: tuple[int, ...] = ()
    train_end: datetime | None = None  # the end of its last training segment (its checkpoint follows)
    stop_at: datetime | None = None  # train_end when the plan ends the stretch a step or more before the window

    @property
    def checkpoints(self) -> bool:
        """True when the stretch ends with a checkpoint: the job continues another night."""
        return bool(self.parts) and self.parts[-1] == "checkpoint"


@dataclass(frozen=True)
class NightOutcome:
    """What a night's run made of a job: its new status and whether the queue plans it again."""

    status: str
    replanned: bool
    reason: str


def remaining(job: QueuedJob, progress: JobProgress | None) -> QueuedJob | None:
    """The job as the plan should see it now: the steps it has left (None when it has none, or is done); a job that
    trained before pays a restore on top of its first stretch's provisioning."""
    if progress is None:
        return job
    if progress.status == "done":
        return None
    left = job.steps - progress.steps_done
    if left <= 0:
        return None
    restore = job.restore_s if progress.steps_done > 0 else 0.0
    return job.model_copy(update={"steps": left, "provisioning_s": job.provisioning_s + restore})


def tonight_window(schedule: ScheduleSpec, at: datetime) -> Interval | None:
    """The window `at` lies in (tonight), or None outside every window."""
    return current_window(schedule, aware_utc(at, "at"))


def next_night(schedule: ScheduleSpec, at: datetime) -> Interval:
    """The next window to start after `at` (where a run outside every window points)."""
    return next_window(schedule, aware_utc(at, "at"))


def tonight(plan: QueuePlan, window: Interval) -> list[NightStretch]:
    """The plan's stretches that start inside `window`, in start order (then placement order). A stretch is a run
    of one job's contiguous segments that begins with its provisioning; `after` names the jobs whose stretches
    tonight end before it and held some of its nodes."""
    out: list[NightStretch] = []
    for pj in plan.jobs:
        cur: list = []
        for seg in pj.segments:
            if cur and (seg.what == "provisioning" or seg.start != cur[-1].end):
                out.append(_stretch(pj.job.id, cur))
                cur = []
            cur.append(seg)
        if cur:
            out.append(_stretch(pj.job.id, cur))
    step_s = {pj.job.id: pj.job.step_time_s for pj in plan.jobs}
    picked = [_stop(s, window, step_s[s.job_id]) for s in out if window.start <= s.start < window.end]
    order = {pj.job.id: i for i, pj in enumerate(plan.jobs)}
    picked.sort(key=lambda s: (s.start, order[s.job_id]))
    done: list[NightStretch] = []
    for s in picked:
        before = sorted({p.job_id for p in done if p.end <= s.start and set(p.nodes) & set(s.nodes)})
        done.append(dataclasses.replace(s, after=tuple(j for j in before if j != s.job_id)))
    return done


def _stop(s: NightStretch, window: Interval, step_s: float) -> NightStretch:
    """A checkpointed stretch the plan ends a step or more before the window's end (the nightly budget, or nodes
    another job takes) stops training where the plan put its checkpoint; one that ends with the window (short of it
    by less than a step: the plan trains whole steps) keeps the gate's window deadline."""
    early = s.checkpoints and s.train_end is not None and (window.end - s.end).total_seconds() >= step_s
    return dataclasses.replace(s, stop_at=s.train_end if early else None)


def _stretch(job_id: int, segs: list) -> NightStretch:
    return NightStretch(
        job_id=job_id,
        start=segs[0].start,
        end=segs[-1].end,
        nodes=segs[0].nodes,
        training_s=sum(s.seconds for s in segs if s.what == "training"),
        parts=tuple(s.what for s in segs),
        train_end=max((s.end for s in segs if s.what == "training"), default=None),
    )


def night_outcome(run_status: str | None, steps_done: int, total_steps: int) -> NightOutcome:
    """The job's status after a night whose pipeline run ended `run_status` (None: the run raised or crashed) with
    `steps_done` of its `total_steps` trained: completed → done; split or stopped with steps left → split (the
    next night resumes its checkpoint); failed, cancelled, crashed, preempted, deferred or refused → queued, planned
    again from the next night with what it has left."""
    if run_status == "completed" or (steps_done >= total_steps > 0):
        return NightOutcome("done", False, "trained all its steps")
    if run_status in ("split", "stopped"):
        return NightOutcome("split", True, f"{steps_done}/{total_steps} steps; continues next night")
    what = run_status or "crashed"
    return NightOutcome("queued", True, f"the night's run ended {what}; planned again ({steps_done} steps kept)")


@dataclass(frozen=True)
class StretchPlacement:
    """How the queue runs one stretch's pipeline: the key of its cluster lock (cluster name and node indices, so
    jobs sharing a cluster.name on disjoint nodes run side by side; the queue orders those that share nodes), when
    its training stops (NightStretch.stop_at; None: the gate's own deadline, the window's end), and the sbatch options that pin it to its nodes (Slurm), with why or why not."""

    lock_key: str
    stop_at: datetime | None
    extra_sbatch: tuple[str, ...] = ()
    pinned: tuple[str, ...] = ()
    note: str = ""

    def provider_spec(self, spec: RunSpec) -> RunSpec:
        """The spec the provider rents with: `spec` plus the pinning options (the run's spec, its hash and ledger
        row stay the job's own)."""
        if not self.extra_sbatch:
            return spec
        out = spec.model_copy(deep=True)
        out.cluster.provider.extra_sbatch = [*out.cluster.provider.extra_sbatch, *self.extra_sbatch]
        return out


def placement(spec: RunSpec, stretch: NightStretch, partition_nodes: list[str] | None) -> StretchPlacement:
    """Place a stretch: lock key, stop time, and on Slurm `--nodelist` of the partition's nodes at the stretch's
    node indices (`partition_nodes` in the partition's order; None when unknown). Without pinning a job gets any
    N nodes of its provider; the queue still never holds more than its max-nodes, as it never runs more at once."""
    nodes = tuple(stretch.nodes)
    key = f"{spec.cluster.name}-nodes-" + "-".join(map(str, nodes))
    pin, pinned, note = _pin(spec, nodes, partition_nodes)
    return StretchPlacement(lock_key=key, stop_at=stretch.stop_at, extra_sbatch=pin, pinned=pinned, note=note)


def _pin(
    spec: RunSpec, nodes: tuple[int, ...], names: list[str] | None
) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    prov = spec.cluster.provider
    if prov.kind != "slurm":
        return (), (), f"{prov.kind} provider: any {len(nodes)} node(s) of it (no node list to pin)"
    if names is None:
        return (), (), f"partition {prov.partition!r}: its nodes are not known; any {len(nodes)} of it"
    if max(nodes, default=0) >= len(names):
        return (
            (),
            (),
            (
                f"partition {prov.partition!r} has {len(names)} node(s), fewer than the queue's node {max(nodes)}; "
                f"any {len(nodes)} of it"
            ),
        )
    own = [o for o in prov.extra_sbatch if o.startswith(("--nodelist", "-w", "--exclude", "-x"))]
    if own:
        return (), (), f"cluster.provider.extra_sbatch already chooses nodes ({own[0]}); kept as given"
    chosen = tuple(names[i] for i in nodes)
    bad = sorted(set(chosen) & set(prov.exclude))
    if bad:
        return (), (), f"cluster.provider.exclude names {bad}, which the queue's nodes {list(nodes)} are; any node"
    return (f"--nodelist={','.join(chosen)}",), chosen, f"pinned to {','.join(chosen)} (nodes {list(nodes)})"
