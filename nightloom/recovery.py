"""Unattended recovery, the pure part: detect a stalled run, classify a failure, decide the next attempt.

The training stage (tasks/recovery.py) runs the loop; everything it decides comes from here, so the rules
can be read and tested without processes:

- detect: a non-zero exit (a rank died, or its peers' collective timed out) or a run that stops reporting
  (`Watchdog`: no new step within max(STALL_FACTOR × median step time, collective timeout));
- classify: preflight is re-run on every node; a node that fails it now is a node problem (excluded, or
  replaced by a spare), a failed cross-node all-reduce with healthy nodes is a network problem, anything
  else is transient (retried on the same nodes);
- decide: within `recovery.max_attempts` and `recovery.max_minutes` (the sum of time-to-recover), with
  enough GPUs left and `allow_relayout` when the world size changes; otherwise give up with the reason.

Provider interface for recovery (`Reacquirer`): `reacquire(cluster, exclude) -> Cluster` returns the nodes
to relaunch on: the healthy ones plus any spare the provider can add, with a fresh rendezvous. `local`
implements it with spare process groups, `ssh` drops the failed host (spares come from the spec's `spare`
hosts at acquire time), Slurm would resubmit with `--exclude=<failed hostnames>`. A provider without it
gets `without_nodes` (drop the failed nodes, keep the rest).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from nightloom.provision.base import Cluster, PreflightReport
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


class Reacquirer(Protocol):
    """A provider that can hand back a cluster without some nodes (and with spares, where it has them)."""

    def reacquire(self, cluster: Cluster, exclude: dict[str, str]) -> Cluster: ...


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

    def give_up_reason(self, relaunches_done: int, recovery_s_spent: float) -> str | None:
        if relaunches_done >= self.max_attempts:
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
    nodes = [n for n in cluster.nodes if n.name not in exclude]
    out = cluster.model_copy(deep=True, update={"nodes": nodes, "excluded": {**cluster.excluded, **exclude}})
    if nodes and cluster.master_addr not in {n.address for n in nodes}:
        out.master_addr = nodes[0].address
    return out


def reacquire(provider, cluster: Cluster, exclude: dict[str, str]) -> Cluster:
    """The provider's `reacquire` where it has one, else `without_nodes`."""
    fn = getattr(provider, "reacquire", None)
    return fn(cluster, exclude) if callable(fn) else without_nodes(cluster, exclude)


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
        with open(path.with_name("metrics-discarded.jsonl"), "a", encoding="utf-8") as f:
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
