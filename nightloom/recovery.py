"""Unattended recovery, the pure part: detect a stalled run, classify a failure, decide the next attempt.

The training stage (tasks/recovery.py) runs the loop; everything it decides comes from here, so the rules
can be read and tested without processes:

- detect (nightloom/attempt.py, over the rules here): a non-zero exit (a rank died, or its peers' collective
  timed out) or a run that stops reporting (`Watchdog`: no new step within max(STALL_FACTOR × median step
  time, collective timeout), × CHECKPOINT_STALL_MULTIPLIER after a checkpoint step, STARTUP_TIMEOUT_S before
  the first step);
- classify: preflight is re-run on every node; a node that fails it now is a node problem (excluded, or
  replaced by a spare), a failed cross-node all-reduce with healthy nodes is a network problem, anything
  else is transient (retried on the same nodes), and so is a preflight whose outcome is unknown (it
  could not run, or, on Kubernetes, had nothing to probe), which is said in the detail;
- decide (`next_attempt`): within `recovery.max_attempts` and `recovery.max_minutes` (the sum of
  time-to-recover), with enough GPUs left and `allow_relayout` when the world size changes, relaunch;
  otherwise give up with the reason;
- account: each interruption is an `Event`, timed (`close_interruption`) once the next attempt reports
  its first step; `RecoveryAccount` holds what recovery has spent of its budget between attempts.

Both training backends go through these rules: native training (tasks/recovery.py, `RecoveryState`) and
XTuner (nightloom/finetune/attempts.py), so max_attempts, max_minutes, allow_relayout and spare_nodes mean
the same on either.

Every provider implements `Provider.reacquire(cluster, exclude) -> Cluster`: the nodes to relaunch on, the
healthy ones plus any spare the provider can add. `local` adds spare process groups (preflighted, on a
fresh port), `ssh` adds spare (or not yet used) hosts after preflighting them, `slurm` releases the
allocation and submits a new one with `--exclude=<failed hostnames>` (with nothing to exclude it keeps the
allocation), `kubernetes` returns `Cluster.without(exclude)`; its preflight never names a failed pod, so
there it is the same cluster and the relaunch is a fresh Job of the spec's size.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Literal, TypeVar

from nightloom.ledger.records import Interruption
from nightloom.provision.base import Cluster, PreflightReport, Provider
from nightloom.runfiles import RunFiles
from nightloom.schedule.cost import BillingSpan
from nightloom.train.job import TrainJob
from nightloom.util import atomic_write_text

#: a run "stops reporting" after this many median step times without a new step (or the collective timeout)
STALL_FACTOR = 10.0
#: after a checkpoint step the next line may take a save longer: the stall allowance is multiplied by this
CHECKPOINT_STALL_MULTIPLIER = 3.0
#: before the first step of the first attempt (startup: imports, model build, peak measurement)
STARTUP_TIMEOUT_S = 1800.0

Signal = Literal["exit", "killed", "collective-timeout", "stall", "no-result"]
Kind = Literal["node", "network", "transient"]

_STEP = re.compile(r"^\[(?P<node>[^\]]+)\] step (?P<step>\d+)/(?P<total>\d+) ")
_KILLED = re.compile(r"Signal \d+ \(SIG\w+\) received by PID")
_TIMEOUT = re.compile(r"(?i)(timed out|timeout|DistBackendError|Connection closed by peer|Connection reset)")


def parse_step(line: str) -> int | None:
    """The step number of a trainer progress line (`[node] step N/M loss ...`), else None."""
    m = _STEP.match(line)
    return int(m.group("step")) if m else None


@dataclass
class Watchdog:
    """Tracks progress lines; `overdue(now)` says how long the run has been silent beyond its allowance."""

    collective_timeout_s: float
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    checkpoint_every: int = 0
    factor: float = STALL_FACTOR
    started: float = 0.0
    last_at: float | None = None
    last_step: int | None = None
    step_times: list[float] = field(default_factory=list)

    def step(self, n: int, now: float) -> None:
        if self.last_at is not None and self.last_step is not None and n == self.last_step + 1:
            self.step_times.append(now - self.last_at)
        self.last_at, self.last_step = now, n

    def allowance(self) -> float:
        """Seconds of silence allowed from now on (startup before the first step)."""
        if self.last_at is None:
            return self.startup_timeout_s
        median = statistics.median(self.step_times) if self.step_times else 0.0
        allow = max(self.factor * median, self.collective_timeout_s)
        if self.checkpoint_every and self.last_step and self.last_step % self.checkpoint_every == 0:
            allow *= CHECKPOINT_STALL_MULTIPLIER
        return allow

    def overdue(self, now: float) -> float | None:
        """Seconds of silence when past the allowance, else None."""
        since = self.last_at if self.last_at is not None else self.started
        silent = now - since
        return silent if silent > self.allowance() else None


@dataclass(frozen=True)
class AttemptFailure:
    """How one launch ended badly: exit code, whether it stalled, the cause line and the progress made."""

    attempt: int
    exit_code: int | None
    stalled: bool
    cause: str
    last_step: int | None  # last step this attempt reported (None: none)
    first_failed_node: str | None = None  # the node whose processes exited non-zero first
    at_unix: float = 0.0  # when the failure was detected
    silent_s: float = 0.0  # how long the run had been silent when it was detected

    @property
    def rendezvous_port_taken(self) -> bool:
        """The launch died before step 1 because its rendezvous port was taken (another job bound it between
        the provider's free-port check and torchrun's bind): a race, not a fault, so the relaunch on a fresh
        port is not counted against max_attempts (its time is)."""
        cause = self.cause.lower()
        return self.last_step is None and ("eaddrinuse" in cause or "address already in use" in cause)

    @classmethod
    def unexplained(cls, attempt: int, cause: str, at_unix: float) -> AttemptFailure:
        """A failure the attempt did not describe (an error raised before or around the launch)."""
        return cls(attempt=attempt, exit_code=None, stalled=False, cause=cause, last_step=None, at_unix=at_unix)

    @property
    def signal(self) -> Signal:
        if self.stalled:
            return "stall"
        if self.exit_code == 0:
            return "no-result"
        if self.exit_code is not None and (self.exit_code < 0 or self.exit_code in (128 + 9, 128 + 15)):
            return "killed"
        if _KILLED.search(self.cause or ""):  # torchrun exits 1 and reports the worker's signal
            return "killed"
        if _TIMEOUT.search(self.cause or ""):
            return "collective-timeout"
        return "exit"


@dataclass(frozen=True)
class Diagnosis:
    """Preflight's verdict after a failure: the kind and the nodes to exclude (name -> reason)."""

    kind: Kind
    bad_nodes: dict[str, str]
    detail: str


def classify(failure: AttemptFailure, report: PreflightReport | None) -> Diagnosis:
    """Node problem when preflight fails on a node now; network when only the cross-node test fails;
    transient otherwise (including no report: the provider could not run preflight at all)."""
    where = f" (first to exit: {failure.first_failed_node})" if failure.first_failed_node else ""
    head = f"{failure.signal}{where}: {failure.cause}"
    if report is not None and report.failed:
        bad = {r.node: r.reason for r in report.failed}
        return Diagnosis(
            "node", bad, f"{head}; preflight failed on " + "; ".join(f"{n}: {why}" for n, why in bad.items())
        )
    if report is not None and report.allreduce_ok is False:
        return Diagnosis(
            "network", {}, f"{head}; all nodes healthy but the all-reduce test failed: {report.allreduce_detail}"
        )
    if report is None or report.outcome == "unknown":  # never claim a pass nothing checked
        why = "no report" if report is None else report.unknown_reason
        return Diagnosis("transient", {}, f"{head}; preflight outcome unknown: {why}")
    return Diagnosis("transient", {}, f"{head}; preflight passed on every node")


@dataclass(frozen=True)
class Budget:
    """recovery.max_attempts relaunches and recovery.max_minutes of time-to-recover, summed."""

    max_attempts: int
    max_minutes: float

    @classmethod
    def from_spec(cls, recovery) -> Budget:
        return cls(recovery.max_attempts, recovery.max_minutes)

    def give_up_reason(self, relaunches_done: int, recovery_s_spent: float, free: bool = False) -> str | None:
        """Why the budget allows no further relaunch, or None. `free`: a relaunch max_attempts does not count
        (time still does)."""
        if relaunches_done >= self.max_attempts and not free:
            return f"out of attempts: {relaunches_done} of recovery.max_attempts={self.max_attempts} relaunches used"
        if recovery_s_spent >= self.max_minutes * 60:
            return (
                f"out of time: {recovery_s_spent / 60:.1f} min spent recovering, "
                f"recovery.max_minutes={self.max_minutes:g}"
            )
        return None

    def remaining_s(self, recovery_s_spent: float) -> float:
        return max(0.0, self.max_minutes * 60 - recovery_s_spent)


def relayout_reason(
    old_world: int, new_world: int, nodes_left: int, min_nodes: int, allow_relayout: bool
) -> str | None:
    """Why the run cannot go on with `new_world` GPUs on `nodes_left` nodes, or None when it can."""
    if nodes_left < min_nodes or new_world == 0:
        return f"too few GPUs left: {new_world} GPU(s) on {nodes_left} node(s), need at least {min_nodes} node(s)"
    if new_world != old_world and not allow_relayout:
        return (
            f"{old_world} -> {new_world} GPUs needs a new layout and recovery.allow_relayout is false "
            "(and no spare node could replace the lost one)"
        )
    return None


def without_nodes(cluster: Cluster, exclude: dict[str, str]) -> Cluster:
    """The cluster minus `exclude` (name -> reason); rendezvous moves to the first node left."""
    return cluster.without(exclude)


def reacquire(provider: Provider, cluster: Cluster, exclude: dict[str, str]) -> Cluster:
    """The nodes to relaunch on after excluding `exclude` (the provider's own rule: spares, resubmission)."""
    return provider.reacquire(cluster, exclude)


def interruption_rate(interruptions: int, train_s: float) -> float:
    """Interruptions per hour of training wall time (0 when nothing ran)."""
    return interruptions / (train_s / 3600) if train_s > 0 else 0.0


@dataclass(frozen=True)
class Rewind:
    """What rewinding the metrics file to the checkpoint discarded: steps to redo and their time."""

    resume_step: int
    discarded_steps: int
    discarded_s: float


def rewind_metrics(metrics_path, resume_step: int) -> Rewind:
    """Keep metrics lines of steps <= `resume_step` (the checkpoint the next attempt resumes from), so the
    file stays one line per step; the discarded lines are appended to `metrics-discarded.jsonl` beside it."""
    path = Path(metrics_path)
    if not path.is_file():
        return Rewind(resume_step, 0, 0.0)
    keep, drop = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            drop.append(line)  # a torn last line of a killed writer
            continue
        (keep if step <= resume_step else drop).append(line)
    if drop:
        with open(RunFiles(path.parent).discarded_metrics, "a", encoding="utf-8") as f:
            f.write("".join(x + "\n" for x in drop))
    atomic_write_text(path, "".join(x + "\n" for x in keep))
    secs = 0.0
    for x in drop:
        try:
            secs += float(json.loads(x).get("step_time_s") or 0.0)
        except (ValueError, AttributeError):
            pass
    return Rewind(resume_step, len(drop), secs)


def first_step_time(metrics_path, attempt: int, after_unix: float = 0.0) -> float | None:
    """Unix time at which `attempt` completed its first step after `after_unix` (from the metrics file; a run
    continued in a later window may hold lines of an earlier flow run's attempt with the same number)."""
    path = Path(metrics_path)
    if not path.is_file():
        return None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("attempt", 0) == attempt and obj.get("time") is not None and obj["time"] > after_unix:
            return float(obj["time"])
    return None


# ------------------------------------------------------------------------------------------------ decide

#: what an attempt runs with: a ParallelPlan (native training) or an XTunerPlan (its rendered config)
P = TypeVar("P")


@dataclass(frozen=True)
class Relaunch(Generic[P]):
    """Go on: the next attempt runs on `cluster` with `plan` (re-planned when the world size changed)."""

    cluster: Cluster
    plan: P


@dataclass(frozen=True)
class GiveUp:
    """Stop: `reason` says why; `cluster` holds the nodes reacquired before deciding (teardown must reach them)."""

    reason: str
    cluster: Cluster | None = None


def next_attempt(
    budget: Budget,
    relaunches: int,
    spent_s: float,
    current: Cluster,
    plan: P,
    *,
    min_nodes: int,
    allow_relayout: bool,
    reacquire: Callable[[], Cluster],
    replan: Callable[[int], P],
    free: bool = False,
    futile: str | None = None,
) -> Relaunch[P] | GiveUp:
    """Relaunch or give up after a failure, in this order: the budget (nothing reacquired when it is spent),
    `futile` (why a relaunch would only repeat the failure, when the caller knows), the nodes `reacquire()`
    gives back (enough of them, relayout allowed), then a plan for their world size (`replan(world)`, only
    when it changed; an error there is the reason to give up). `free`: this relaunch is not counted against
    max_attempts (XTuner's known gloo abort); time is."""
    reason = budget.give_up_reason(relaunches, spent_s, free) or futile
    if reason is not None:
        return GiveUp(reason)
    nxt = reacquire()
    reason = relayout_reason(current.world_size, nxt.world_size, len(nxt.nodes), min_nodes, allow_relayout)
    if reason is not None:
        return GiveUp(reason, nxt)
    if nxt.world_size == current.world_size:
        return Relaunch(nxt, plan)
    try:
        return Relaunch(nxt, replan(nxt.world_size))
    except Exception as e:  # noqa: BLE001 - PlanError/LayoutError: named in the reason
        return GiveUp(f"no layout for {nxt.world_size} GPU(s): {type(e).__name__}: {e}", nxt)


# ------------------------------------------------------------------------------------------------ account


class Event(Interruption):
    """One interruption as recorded: the ledger's Interruption (cause, time to recover, None: not recovered; time
    lost and its cost) with the attempt it ended, the steps redone, and the world and layout before and after."""

    attempt: int
    redone_steps: int = 0
    world_before: int = 0
    world_after: int | None = None
    layout_after: str | None = None

    def ledger_fields(self) -> dict:
        """The fields the ledger keeps (Interruption's), the detail cut to 2,000 characters."""
        return {**self.model_dump(include=set(Interruption.model_fields)), "detail": self.detail[:2000]}


@dataclass
class Pending:
    """An interruption recovered from, waiting for the next attempt's first step to time the recovery."""

    event: Event
    detected_unix: float
    silent_s: float  # silence before detection (part of the time lost)
    redone_s: float  # step time of the discarded steps (redone after the resume)
    gpus: int


def close_interruption(p: Pending, first_step_unix: float | None, now_unix: float, finished: bool = False) -> Event:
    """Time `p.event`: recovery_s from detection to the next attempt's first step (`now_unix` when that attempt
    finished with no step left to redo; None, "not recovered", when it never reported one); lost_s adds the
    silence before detection and the redone steps. Cost is the caller's (it depends on the price schedule)."""
    e = p.event
    first = first_step_unix if first_step_unix is not None else (now_unix if finished else None)
    if first is not None:
        e.recovery_s = round(max(0.0, first - p.detected_unix), 3)
    else:
        e.detail += "; not recovered"
    spent = e.recovery_s if e.recovery_s is not None else max(0.0, now_unix - p.detected_unix)
    e.lost_s = round(p.silent_s + spent + p.redone_s, 3)
    return e


def recovery_summary(events: list[Event], train_s: float) -> str:
    """One line: interruptions, their rate per hour of training, and the mean time to recover."""
    rate = interruption_rate(len(events), train_s)
    recovered = [e.recovery_s for e in events if e.recovery_s is not None]
    mean = sum(recovered) / len(recovered) if recovered else None
    return f"{len(events)} interruption(s) in {train_s:.0f} s of training: {rate:.2f}/h; mean time to recover " + (
        f"{mean:.1f} s" if mean is not None else "-"
    )


@dataclass
class RecoveryAccount:
    """What recovery has spent of its budget, on either backend: relaunches, time to recover (summed:
    recovery.max_minutes), the interruptions so far and the one waiting for the next attempt's first step."""

    budget: Budget
    relaunches: int = 0
    free_relaunches: int = 0  # of them, those max_attempts does not count (a lost rendezvous-port race)
    spent_s: float = 0.0  # time-to-recover summed (recovery.max_minutes)
    preemptions: int = 0  # relaunches after a preemption (recovery.max_preemptions), not counted above
    events: list[Event] = field(default_factory=list)
    pending: Pending | None = None

    def startup_timeout_s(self) -> float | None:
        """How long a relaunch may take to its first step: the recovery time left (None: the first attempt)."""
        return None if self.relaunches == 0 else max(1.0, self.budget.remaining_s(self.spent_s))

    def charge(self, failed_at_unix: float) -> None:
        """Count the pending interruption's time to recover (until this failure when it never recovered; the
        caller closed it first) and clear it."""
        if self.pending is None:
            return
        r = self.pending.event.recovery_s
        if self.pending.event.kind != PREEMPTION:  # a preemption's restart is not charged to max_minutes
            self.spent_s += r if r is not None else max(0.0, failed_at_unix - self.pending.detected_unix)
        self.pending = None


#: Event.kind (and the ledger's interruption kind) of an attempt that stopped on a preemption notice
PREEMPTION = "preemption"


def preemption_reason(preemptions_done: int, max_preemptions: int) -> str | None:
    """Why a preempted run is not relaunched (recovery.max_preemptions used), or None."""
    if preemptions_done >= max_preemptions:
        return f"out of preemptions: {preemptions_done} of recovery.max_preemptions={max_preemptions} relaunches used"
    return None


@dataclass(kw_only=True)
class RecoveryState(RecoveryAccount):
    """Native training's recovery loop between attempts: the account, plus where the next attempt runs."""

    cluster: Cluster  # the nodes of the current attempt
    job: TrainJob  # the current attempt's job
    seen: Cluster  # every node held so far (what teardown must reach)
    started: float  # monotonic time the train stage began
    spans: list[BillingSpan] = field(default_factory=list)  # each attempt (and the recovery after it) at its size

    def advance(self, to: Relaunch, pending: Pending, free: bool = False) -> None:
        """Move on to the next attempt: on `to.cluster` with `to.plan`, resuming from the latest checkpoint.
        `free`: a relaunch max_attempts does not count."""
        self.relaunches += 1
        self.free_relaunches += int(free)
        self.pending = pending
        self.cluster = to.cluster
        self.job = self.job.model_copy(update={"plan": to.plan, "attempt": self.job.attempt + 1, "resume": True})

    def after_preemption(self, cluster: Cluster, pending: Pending) -> None:
        """Move on after a preemption: same plan, on `cluster`, from the checkpoint saved at the agreed step;
        counted in `preemptions`, not against max_attempts."""
        self.preemptions += 1
        self.pending = pending
        self.cluster = cluster
        self.job = self.job.model_copy(update={"attempt": self.job.attempt + 1, "resume": True})
