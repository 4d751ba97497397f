"""The train stage with unattended recovery: attempt → (failure) diagnose → exclude/replace → re-plan → resume.

Runs inside the pipeline flow, so every attempt, diagnosis and re-plan is a task run of the same Prefect flow
run; the run keeps its folder (checkpoints, metrics.jsonl) and its ledger row. The rules (what counts as a
node problem, relaunch or give up, how an interruption is timed) are in nightloom/recovery.py; this module
does the I/O they need (preflight, reacquire, re-plan, ledger rows, the recovery artifact).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom import recovery as rec
from nightloom.ledger import Ledger
from nightloom.provision.base import Cluster, PreflightReport, Provider, ProvisionError
from nightloom.provision.shared_folder import check_shared_folder
from nightloom.report import NOT_MEASURED
from nightloom.schedule.cost import BillingSpan, lost_time_cost
from nightloom.spec import RunSpec
from nightloom.train.job import TrainJob, TrainOutcome, TrainResult
from nightloom.train.preempt import PREEMPTED, Forward
from tasks.plan import plan_task
from tasks.teardown import record_cluster
from tasks.train import TrainingFailed, train_task


class RecoveryGaveUp(TrainingFailed):
    """Training failed and recovery stopped: out of attempts or time, or too few GPUs for any layout.
    The checkpoint is kept; the message gives the reason and the failure."""


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
def record_interruption_task(ledger_url: str, run_id: str, e: rec.Event) -> None:
    with Ledger(ledger_url) as ledger:
        ledger.record_interruption(run_id, **e.ledger_fields())
    get_run_logger().info(
        "recorded interruption of attempt %d in ledger row %s: %s (recovery %s s, lost %s s)",
        e.attempt,
        run_id,
        e.kind,
        "n/a" if e.recovery_s is None else f"{e.recovery_s:.1f}",
        "n/a" if e.lost_s is None else f"{e.lost_s:.1f}",
    )


def _cost(spec: RunSpec, at: datetime, seconds: float, gpus: int) -> float:
    return 0.0 if spec.cluster.gpu_type == "cpu" else lost_time_cost(spec.schedule, at, seconds, gpus)


def _close(spec: RunSpec, p: rec.Pending, job: TrainJob, finished: bool = False) -> None:
    """Time, price and record an interruption once `job` (the next attempt) reported a step, failed or finished."""
    e = p.event
    first = (
        rec.first_step_time(job.metrics_path, job.attempt, p.detected_unix) if job.attempt == e.attempt + 1 else None
    )
    rec.close_interruption(p, first, time.time(), finished)
    e.cost = _cost(spec, e.at, e.lost_s, p.gpus)
    record_interruption_task(spec.ledger.url, job.run_id, e)


def _artifact(events: list[rec.Event], train_s: float, outcome: str) -> None:
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
            "layout_after": e.layout_after or NOT_MEASURED,
            "detail": e.detail[:300],
        }
        for e in events
    ]
    rows.append(
        {
            "attempt": "total",
            "kind": outcome,
            "recovery_s": round(sum(e.recovery_s for e in events if e.recovery_s is not None), 3),
            "lost_s": round(sum(e.lost_s or 0 for e in events), 3),
            "cost": sum(e.cost or 0 for e in events),
            "redone_steps": sum(e.redone_steps for e in events),
            "gpus": "",
            "layout_after": "",
            "detail": rec.recovery_summary(events, train_s),
        }
    )
    try:
        create_table_artifact(key="recovery", table=rows, description="Interruptions and time to recover")
    except Exception as e:  # noqa: BLE001 - an artifact never fails the run
        get_run_logger().warning("could not write the recovery artifact: %s", type(e).__name__)


def _span(start: datetime, gpus: int) -> BillingSpan:
    return BillingSpan.between(start, datetime.now(UTC), gpus)


def train_with_recovery(spec: RunSpec, provider: Provider, cluster: Cluster, job: TrainJob) -> TrainOutcome:
    """Train; on a failure diagnose, exclude or replace nodes, re-plan and resume from the latest checkpoint,
    within spec.recovery; raise RecoveryGaveUp (checkpoint kept, reason given) when it must stop."""
    budget = rec.Budget.from_spec(spec.recovery)
    st = rec.RecoveryState(budget, cluster=cluster, job=job, seen=cluster, started=time.monotonic())
    while True:
        span_start = datetime.now(UTC)
        try:
            result = train_task(
                provider,
                st.cluster,
                st.job,
                startup_timeout_s=st.startup_timeout_s(),
                preempt_grace_s=spec.recovery.preempt_grace_s,
            )
        except TrainingFailed as err:
            _recover(spec, provider, st, err, span_start)  # ready for the next attempt, or raises RecoveryGaveUp
            continue
        if result.stopped == PREEMPTED and _after_preemption(spec, provider, st, result, span_start):
            continue
        return _finish(spec, st, result, span_start)


def _after_preemption(spec: RunSpec, provider: Provider, st: rec.RecoveryState, result: TrainResult, span_start):
    """A preempted attempt (every rank saved at one step): relaunch from that checkpoint on the same or
    replacement nodes, within recovery.max_preemptions (apart from max_attempts); False when the run stops here
    (the orchestrator itself was told to stop, or no preemption is left): `nightloom run --resume` continues."""
    log = get_run_logger()
    if st.pending is not None:
        _close(spec, st.pending, st.job)
        st.charge(time.time())
    at = time.time()
    ev = rec.Event(
        attempt=st.job.attempt,
        kind=rec.PREEMPTION,
        at=datetime.fromtimestamp(at, UTC),
        world_before=st.cluster.world_size,
    )
    st.events.append(ev)
    stop = (f"the orchestrator got {Forward.requested}" if Forward.requested else None) or rec.preemption_reason(
        st.preemptions, spec.recovery.max_preemptions
    )
    ev.detail = f"stopped at step {result.steps_done}/{result.total_steps}, checkpoint {result.last_checkpoint}"
    st.spans.append(_span(span_start, st.cluster.world_size))
    if stop is not None:
        ev.detail += f"; not relaunched: {stop}; continue with nightloom run --resume {st.job.run_id}"
        _close(spec, rec.Pending(ev, at, 0.0, 0.0, st.cluster.world_size), st.job)
        log.warning("preempted at step %d: %s", result.steps_done, ev.detail)
        return False
    nxt = provider.reacquire(st.cluster, {})  # the same nodes where the provider keeps them, else replacements
    st.seen = st.seen.union(nxt)
    record_cluster(st.job.run_dir, st.seen)
    rw = rec.rewind_metrics(st.job.metrics_path, result.steps_done)  # nothing to redo: saved at the stop
    ev.world_after, ev.layout_after, ev.redone_steps = nxt.world_size, st.job.plan.layout(), rw.discarded_steps
    nodes = ", ".join(n.name for n in nxt.nodes)
    ev.detail += f"; relaunched on {nodes} from step {result.steps_done}"
    log.warning(
        "preemption %d/%d at step %d: relaunching on %s from its checkpoint %s",
        st.preemptions + 1,
        spec.recovery.max_preemptions,
        result.steps_done,
        nodes,
        result.last_checkpoint,
    )
    st.after_preemption(nxt, rec.Pending(ev, at, 0.0, rw.discarded_s, st.cluster.world_size))
    return True


def _check_new_nodes(spec: RunSpec, provider: Provider, before: Cluster, decision: rec.Relaunch, run_dir: Path):
    """The relaunch, or a GiveUp naming the new node(s) that do not share the run folder (ssh, slurm)."""
    seen = {n.name for n in before.nodes}
    new = [n for n in decision.cluster.nodes if n.name not in seen]
    if not new:
        return decision
    try:
        check_shared_folder(provider, decision.cluster.model_copy(update={"nodes": new}), run_dir)
    except ProvisionError as e:
        return rec.GiveUp(str(e), decision.cluster)
    return decision


def _recover(spec: RunSpec, provider: Provider, st: rec.RecoveryState, err: TrainingFailed, span_start) -> None:
    """After a failed attempt: diagnose, decide, and either prepare the relaunch in `st` or give up."""
    from nightloom.train import checkpoint  # imports torch: only on the training path

    failure = err.failure or rec.AttemptFailure.unexplained(st.job.attempt, str(err), time.time())
    if st.pending is not None:
        _close(spec, st.pending, st.job)
        st.charge(failure.at_unix)
    at = datetime.fromtimestamp(failure.at_unix, UTC)
    ev = rec.Event(attempt=st.job.attempt, kind="failure", detail=str(err), at=at, world_before=st.cluster.world_size)
    st.events.append(ev)
    diag = diagnose_task(provider, st.cluster, failure)  # classified even when giving up: the ledger
    ev.kind, ev.detail = diag.kind, diag.detail  # compares causes between providers
    decision = rec.next_attempt(
        st.budget,
        st.relaunches - st.free_relaunches,
        st.spent_s,
        st.cluster,
        st.job.plan,
        min_nodes=spec.cluster.min_nodes or 1,
        allow_relayout=spec.recovery.allow_relayout,
        reacquire=lambda: provider.reacquire(st.cluster, diag.bad_nodes),
        replan=lambda world: plan_task(spec, world),
        free=failure.rendezvous_port_taken,  # reacquire gives a fresh port; a lost race is not a failure
    )
    if decision.cluster is not None:
        st.seen = st.seen.union(decision.cluster)
        record_cluster(st.job.run_dir, st.seen)
    if isinstance(decision, rec.Relaunch):  # a spare must see the run folder too, as the first nodes did
        decision = _check_new_nodes(spec, provider, st.cluster, decision, Path(st.job.run_dir))
    found = checkpoint.latest(st.job.checkpoint_dir)
    resume_step = found[1] if found else 0
    if isinstance(decision, rec.GiveUp):
        kept = f"checkpoint at step {resume_step} kept in {st.job.checkpoint_dir}" if found else "no checkpoint"
        _give_up(spec, provider, st, err, failure, decision.reason, kept)
    nxt, layout = decision.cluster, decision.plan.layout()
    rw = rec.rewind_metrics(st.job.metrics_path, resume_step)
    ev.redone_steps, ev.world_after, ev.layout_after = rw.discarded_steps, nxt.world_size, layout
    nodes = ", ".join(n.name for n in nxt.nodes)
    ev.detail += (
        f"; resumed from step {resume_step} on {nodes} ({st.cluster.world_size} -> {nxt.world_size} GPUs, "
        f"layout {layout}), {rw.discarded_steps} step(s) redone"
    )
    get_run_logger().warning(
        "recovery %d/%d: %s; relaunching on %s (%d GPUs, layout %s) from step %d; %d step(s) to redo",
        st.relaunches + 1,
        st.budget.max_attempts,
        diag.kind,
        nodes,
        nxt.world_size,
        layout,
        resume_step,
        rw.discarded_steps,
    )
    pending = rec.Pending(ev, failure.at_unix, failure.silent_s, rw.discarded_s, st.cluster.world_size)
    st.spans.append(_span(span_start, st.cluster.world_size))  # the failed attempt and its recovery
    st.advance(decision, pending, free=failure.rendezvous_port_taken)


def _give_up(spec: RunSpec, provider: Provider, st: rec.RecoveryState, err, failure, reason: str, kept: str) -> None:
    """Close the last interruption as not recovered, publish the artifact, release reacquired nodes, raise.
    `kept`: what happened to the checkpoint."""
    ev = st.events[-1]
    ev.detail = f"{ev.detail}; gave up: {reason}"
    _close(spec, rec.Pending(ev, failure.at_unix, failure.silent_s, 0.0, st.cluster.world_size), st.job)
    _artifact(st.events, time.monotonic() - st.started, "gave up")
    if st.seen is not st.cluster:  # a reacquire happened: the flow releases only the first cluster
        provider.release(st.seen)
    msg = f"recovery gave up after {len(st.events)} failure(s): {reason}; {kept}; last failure: {err}"
    get_run_logger().error("%s", msg)
    raise RecoveryGaveUp.of(msg, failure) from None


def _finish(spec: RunSpec, st: rec.RecoveryState, result: TrainResult, span_start: datetime) -> TrainOutcome:
    """The attempt that succeeded: close the open interruption, publish the artifact, return the outcome."""
    if st.pending is not None:
        _close(spec, st.pending, st.job, finished=True)
    train_s = time.monotonic() - st.started
    if st.events:
        _artifact(st.events, train_s, "recovered")
    if result.stopped != PREEMPTED:  # a preempted attempt's span was added when it stopped
        st.spans.append(_span(span_start, st.cluster.world_size))
    preempted = [e for e in st.events if e.kind == rec.PREEMPTION]
    failures = [e for e in st.events if e.kind != rec.PREEMPTION]
    return TrainOutcome(
        result=result.model_copy(update={"wall_s": train_s}),
        cluster=st.cluster,
        plan=st.job.plan,
        spans=st.spans,
        train_s=train_s,
        interruptions=len(failures),
        recovery_s=sum(e.recovery_s or 0.0 for e in failures),
        preemptions=len(preempted),
        preemption_lost_s=sum(e.lost_s or 0.0 for e in preempted),
    )
