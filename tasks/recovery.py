"""The train stage with unattended recovery: attempt → (failure) diagnose → exclude/replace → re-plan → resume.

Runs inside the pipeline flow, so every attempt, diagnosis and re-plan is a task run of the same Prefect flow
run; the run keeps its folder (checkpoints, metrics.jsonl) and its ledger row. The rules (what counts as a
node problem, when to give up) are in nightloom/recovery.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom import recovery as rec
from nightloom.ledger import Ledger
from nightloom.parallel import ParallelPlan
from nightloom.provision.base import Cluster, PreflightReport, Provider
from nightloom.schedule import BillingSpan, lost_time_cost
from nightloom.spec import RunSpec
from nightloom.train.job import TrainJob, TrainResult
from tasks.plan import plan_task
from tasks.teardown import record_cluster
from tasks.train import TrainingFailed, train_task


class RecoveryGaveUp(TrainingFailed):
    """Training failed and recovery stopped: out of attempts or time, or too few GPUs for any layout.
    The checkpoint is kept; the message gives the reason and the failure."""


@dataclass
class Event:
    """One interruption as recorded: cause, time to recover (None: not recovered), time lost and its cost."""

    attempt: int
    kind: str
    detail: str
    at: datetime
    recovery_s: float | None = None
    lost_s: float | None = None
    cost: float | None = None
    redone_steps: int = 0
    world_before: int = 0
    world_after: int | None = None
    layout_after: str | None = None


@dataclass
class Recovered:
    """The train stage's outcome: the result and the cluster/plan the run finished on."""

    result: TrainResult
    cluster: Cluster
    plan: ParallelPlan
    events: list[Event] = field(default_factory=list)
    train_s: float = 0.0
    spans: list[BillingSpan] = field(default_factory=list)  # each attempt (and the recovery after it) at its size

    @property
    def interruptions(self) -> int:
        return len(self.events)

    @property
    def recovery_s(self) -> float:
        return sum(e.recovery_s or 0.0 for e in self.events)


@task(name="diagnose", cache_policy=NO_CACHE)
def diagnose_task(provider: Provider, cluster: Cluster, failure: rec.AttemptFailure) -> rec.Diagnosis:
    """Re-run preflight on every node of the failed attempt and classify the failure."""
    log = get_run_logger()
    try:
        report = provider.preflight(cluster)
    except Exception as e:  # noqa: BLE001 - no report: classified as transient, named in the detail
        log.warning("preflight after the failure could not run: %s: %s", type(e).__name__, e)
        report = PreflightReport(nodes=[], unknown=f"preflight crashed: {type(e).__name__}: {e}")
    d = rec.classify(failure, report)
    log.warning("failure of attempt %d classified %s: %s", failure.attempt, d.kind, d.detail)
    return d


@task(name="ledger-interruption", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def record_interruption_task(ledger_url: str, run_id: str, e: Event) -> None:
    with Ledger(ledger_url) as ledger:
        ledger.record_interruption(
            run_id, kind=e.kind, detail=e.detail[:2000], recovery_s=e.recovery_s, at=e.at, lost_s=e.lost_s, cost=e.cost
        )


def _cost(spec: RunSpec, at: datetime, seconds: float, gpus: int) -> float:
    return 0.0 if spec.cluster.gpu_type == "cpu" else lost_time_cost(spec.schedule, at, seconds, gpus)


@dataclass
class Pending:
    """An interruption recovered from, waiting for the next attempt's first step to time the recovery."""

    event: Event
    detected_unix: float
    silent_s: float  # silence before detection (part of the time lost)
    redone_s: float  # step time of the discarded steps (redone after the resume)
    gpus: int


def _close(spec: RunSpec, run_id: str, p: Pending, job: TrainJob, finished: bool = False) -> None:
    """Time and record an interruption once `job` (the next attempt) reported a step, failed or finished."""
    e = p.event
    first = (
        rec.first_step_time(job.metrics_path, job.attempt, p.detected_unix) if job.attempt == e.attempt + 1 else None
    )
    if first is None and finished:
        first = time.time()  # resumed at the last step: nothing left to redo
    if first is not None:
        e.recovery_s = round(max(0.0, first - p.detected_unix), 3)
    else:
        e.detail += "; not recovered"
    spent = e.recovery_s if e.recovery_s is not None else max(0.0, time.time() - p.detected_unix)
    e.lost_s = round(p.silent_s + spent + p.redone_s, 3)
    e.cost = _cost(spec, e.at, e.lost_s, p.gpus)
    record_interruption_task(spec.ledger.url, run_id, e)


def _union(a: Cluster, b: Cluster) -> Cluster:
    """Every node either cluster holds (what teardown must reach)."""
    names = {n.name for n in b.nodes}
    return b.model_copy(update={"nodes": b.nodes + [n for n in a.nodes if n.name not in names]})


def _artifact(events: list[Event], train_s: float, outcome: str) -> None:
    from prefect.artifacts import create_table_artifact

    rows = [
        {
            "attempt": e.attempt,
            "kind": e.kind,
            "recovery_s": e.recovery_s,
            "lost_s": e.lost_s,
            "cost": e.cost,
            "redone_steps": e.redone_steps,
            "gpus": f"{e.world_before} -> {e.world_after if e.world_after is not None else '-'}",
            "layout_after": e.layout_after or "-",
            "detail": e.detail[:300],
        }
        for e in events
    ]
    rate = rec.interruption_rate(len(events), train_s)
    recovered = [e.recovery_s for e in events if e.recovery_s is not None]
    mean = sum(recovered) / len(recovered) if recovered else None
    rows.append(
        {
            "attempt": "total",
            "kind": outcome,
            "recovery_s": round(sum(recovered), 3),
            "lost_s": round(sum(e.lost_s or 0 for e in events), 3),
            "cost": sum(e.cost or 0 for e in events),
            "redone_steps": sum(e.redone_steps for e in events),
            "gpus": "",
            "layout_after": "",
            "detail": f"{len(events)} interruption(s) in {train_s:.0f} s of training: "
            f"{rate:.2f}/h; mean time to recover " + (f"{mean:.1f} s" if mean is not None else "-"),
        }
    )
    try:
        create_table_artifact(key="recovery", table=rows, description="Interruptions and time to recover")
    except Exception as e:  # noqa: BLE001 - an artifact never fails the run
        get_run_logger().warning("could not write the recovery artifact: %s", type(e).__name__)


def train_with_recovery(spec: RunSpec, provider: Provider, cluster: Cluster, job: TrainJob) -> Recovered:
    """Train; on a failure diagnose, exclude or replace nodes, re-plan and resume from the latest checkpoint,
    within spec.recovery; raise RecoveryGaveUp (checkpoint kept, reason given) when it must stop."""
    from nightloom.train import checkpoint  # imports torch: only on the training path

    log = get_run_logger()
    budget = rec.Budget.from_spec(spec.recovery)
    t0 = time.monotonic()
    events: list[Event] = []
    pending: Pending | None = None
    relaunches, spent = 0, 0.0
    cur_cluster, cur_job, seen = cluster, job, cluster
    run_dir = Path(job.run_dir)
    spans: list[BillingSpan] = []
    while True:
        span_start = datetime.now(UTC)
        startup = None if relaunches == 0 else max(1.0, budget.remaining_s(spent))
        try:
            result = train_task(provider, cur_cluster, cur_job, startup_timeout_s=startup)
        except TrainingFailed as err:
            failure = err.failure or rec.AttemptFailure(
                attempt=cur_job.attempt,
                exit_code=None,
                stalled=False,
                cause=str(err),
                last_step=None,
                at_unix=time.time(),
            )
            if pending is not None:
                _close(spec, job.run_id, pending, cur_job)
                r = pending.event.recovery_s
                spent += r if r is not None else max(0.0, failure.at_unix - pending.detected_unix)
                pending = None
            ev = Event(
                attempt=cur_job.attempt,
                kind="failure",
                detail=str(err),
                at=datetime.fromtimestamp(failure.at_unix, UTC),
                world_before=cur_cluster.world_size,
            )
            events.append(ev)
            diag = diagnose_task(provider, cur_cluster, failure)  # classified even when giving up: the ledger
            ev.kind, ev.detail = diag.kind, diag.detail  # compares causes between providers
            reason = budget.give_up_reason(relaunches, spent)
            if reason is None:
                nxt = rec.reacquire(provider, cur_cluster, diag.bad_nodes)
                seen = _union(seen, nxt)
                record_cluster(run_dir, seen)
                reason = rec.relayout_reason(
                    cur_cluster.world_size,
                    nxt.world_size,
                    len(nxt.nodes),
                    spec.cluster.min_nodes or 1,
                    spec.recovery.allow_relayout,
                )
            if reason is None:
                try:
                    plan = cur_job.plan if nxt.world_size == cur_cluster.world_size else plan_task(spec, nxt.world_size)
                except Exception as e:  # noqa: BLE001 - PlanError/LayoutError: named in the reason
                    reason = f"no layout for {nxt.world_size} GPU(s): {type(e).__name__}: {e}"
            found = checkpoint.latest(job.checkpoint_dir)
            resume_step = found[1] if found else 0
            if reason is not None:
                ev.detail = f"{ev.detail}; gave up: {reason}"
                _close(
                    spec,
                    job.run_id,
                    Pending(ev, failure.at_unix, failure.silent_s, 0.0, cur_cluster.world_size),
                    cur_job,
                )
                train_s = time.monotonic() - t0
                _artifact(events, train_s, "gave up")
                if seen is not cluster:
                    provider.release(seen)
                ckpt = f"checkpoint at step {resume_step} kept in {job.checkpoint_dir}" if found else "no checkpoint"
                msg = f"recovery gave up after {len(events)} failure(s): {reason}; {ckpt}; last failure: {err}"
                log.error("%s", msg)
                gave = RecoveryGaveUp(msg)
                gave.failure = failure
                raise gave from None
            rw = rec.rewind_metrics(job.metrics_path, resume_step)
            relaunches += 1
            ev.redone_steps, ev.world_after, ev.layout_after = rw.discarded_steps, nxt.world_size, plan.layout()
            ev.detail += (
                f"; resumed from step {resume_step} on {', '.join(n.name for n in nxt.nodes)} "
                f"({cur_cluster.world_size} -> {nxt.world_size} GPUs, layout {plan.layout()}), "
                f"{rw.discarded_steps} step(s) redone"
            )
            log.warning(
                "recovery %d/%d: %s; relaunching on %s (%d GPUs, layout %s) from step %d; %d step(s) to redo",
                relaunches,
                budget.max_attempts,
                diag.kind,
                ", ".join(n.name for n in nxt.nodes),
                nxt.world_size,
                plan.layout(),
                resume_step,
                rw.discarded_steps,
            )
            pending = Pending(ev, failure.at_unix, failure.silent_s, rw.discarded_s, cur_cluster.world_size)
            spans.append(_span(span_start, cur_cluster.world_size))  # the failed attempt and its recovery
            cur_cluster = nxt
            cur_job = cur_job.model_copy(update={"plan": plan, "attempt": cur_job.attempt + 1, "resume": True})
            continue
        if pending is not None:
            _close(spec, job.run_id, pending, cur_job, finished=True)
        train_s = time.monotonic() - t0
        if events:
            _artifact(events, train_s, "recovered")
        result = result.model_copy(update={"wall_s": train_s})
        spans.append(_span(span_start, cur_cluster.world_size))
        return Recovered(
            result=result, cluster=cur_cluster, plan=cur_job.plan, events=events, train_s=train_s, spans=spans
        )


def _span(start: datetime, gpus: int) -> BillingSpan:
    return BillingSpan.between(start, datetime.now(UTC), gpus)
