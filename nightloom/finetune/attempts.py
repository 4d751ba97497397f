"""XTuner training attempts under nightloom.recovery's rule: launch; on a failure diagnose, decide, resume.

The budget and the next-attempt rule are native training's (`recovery.next_attempt` over a
`RecoveryAccount`): recovery.max_attempts relaunches, recovery.max_minutes of time to recover (failure
detected -> the relaunch's first logged step, summed; a relaunch gets the time left to log its first step),
allow_relayout when the world size changes, and the provider's spare nodes through `reacquire`.
XTuner's own: the known gloo abort while a checkpoint is saved has one relaunch of its own (its time still
counts), a plain crash on healthy nodes is not relaunched (it would repeat), a smaller world is re-rendered
(`replan`) and the nodes of a relaunch are readied (`ready`: env, base model, run folder) before it starts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from nightloom import recovery as rec
from nightloom.attempt import TAIL_LINES, cause_line
from nightloom.finetune.convert import find_checkpoint
from nightloom.finetune.launcher import XTunerLaunchError, check, node_env, run_streaming, train_args, train_command
from nightloom.finetune.logs import StartupDump, step_of
from nightloom.finetune.xtuner_plan import XTunerPlan
from nightloom.provision.base import Cluster, Node, PreflightReport, ProvisionError, follow

Log = Callable[[str], None]

#: An intermittent C++ abort seen on CPU/gloo while mmengine saves a checkpoint (rank 1, after the step's work).
UPSTREAM_ABORT = "terminate called without an active exception"
UPSTREAM_ABORT_RETRIES = 1
#: failure signals a relaunch can cure (a rank killed, a dead peer's collective timing out, no step logged); a
#: plain crash on healthy nodes ("exit") would repeat, so it is raised
RECOVERABLE_SIGNALS = ("killed", "collective-timeout", "stall")


@dataclass
class XTunerRecovery:
    """How a run may recover: the spec's budget and rules, and the run's hooks for a new world or new nodes.
    The default relaunches only the known gloo abort (a run on this machine: no provider, nothing to preflight)."""

    budget: rec.Budget = field(default_factory=lambda: rec.Budget(max_attempts=0, max_minutes=30.0))
    min_nodes: int = 1
    allow_relayout: bool = True
    replan: Callable[[int], XTunerPlan] | None = None  # the config re-rendered for a world size
    ready: Callable[[Cluster, XTunerPlan], XTunerPlan] | None = None  # the relaunch's nodes readied: their plan
    on_cluster: Callable[[Cluster], None] | None = None  # every cluster reacquired (the caller releases it on failure)

    @classmethod
    def from_spec(cls, spec, *, on_a_cluster: bool, **hooks) -> XTunerRecovery:
        """spec.recovery and cluster.min_nodes; without a cluster no relaunch but the gloo abort's own."""
        r = spec.recovery
        budget = rec.Budget(r.max_attempts if on_a_cluster else 0, r.max_minutes)
        return cls(budget, spec.cluster.min_nodes or 1, r.allow_relayout, **hooks)


@dataclass
class Trained:
    """How training ended after recovery: the final checkpoint, the plan and cluster of the last attempt,
    and one recovery Event per interruption (the ledger's rows)."""

    checkpoint: Path
    plan: XTunerPlan
    cluster: Cluster | None
    events: list[rec.Event] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ the rule


def known_abort(launch_text: str, diag: rec.Diagnosis | None) -> bool:
    """The attempt ended in the known gloo abort, on nodes preflight still finds healthy."""
    return UPSTREAM_ABORT in launch_text and not (diag is not None and diag.kind == "node")


def futile_reason(failure: rec.AttemptFailure, diag: rec.Diagnosis | None, launch_text: str) -> str | None:
    """Why a relaunch would only repeat the failure (a plain crash on nodes preflight finds healthy), or None
    when one can cure it: a bad node, a killed rank, a collective timeout, a stall, the known abort."""
    if known_abort(launch_text, diag) or (diag is not None and diag.kind == "node"):
        return None
    if failure.signal in RECOVERABLE_SIGNALS:
        return None
    return f"{failure.signal} on healthy nodes ({diag.kind if diag else 'no preflight'}): a relaunch would repeat it"


def decide(
    failure: rec.AttemptFailure,
    diag: rec.Diagnosis | None,
    launch_text: str,
    account: rec.RecoveryAccount,
    aborts: int,
    current: Cluster,
    plan: XTunerPlan,
    rules: XTunerRecovery,
    reacquire: Callable[[], Cluster],
) -> rec.Relaunch[XTunerPlan] | rec.GiveUp:
    """recovery.next_attempt for a failed XTuner attempt. `aborts`: relaunches the gloo abort's own budget
    paid so far; the others count against recovery.max_attempts, and all of them spend recovery.max_minutes."""
    abort = known_abort(launch_text, diag)
    d = rec.next_attempt(
        account.budget,
        account.relaunches - aborts,
        account.spent_s,
        current,
        plan,
        min_nodes=rules.min_nodes,
        allow_relayout=rules.allow_relayout,
        reacquire=reacquire,
        replan=rules.replan or _no_replan,
        free=abort and aborts < UPSTREAM_ABORT_RETRIES,
        futile=futile_reason(failure, diag, launch_text),
    )
    if isinstance(d, rec.GiveUp) and abort and d.reason.startswith("out of attempts"):
        return rec.GiveUp(f"{d.reason} (and the known gloo abort's own {UPSTREAM_ABORT_RETRIES})", d.cluster)
    return d


def _no_replan(world: int) -> XTunerPlan:
    raise ValueError(f"this run has no config for another world size ({world} rank(s))")


# ------------------------------------------------------------------------------------------------ the loop


def train_with_recovery(
    plan: XTunerPlan,
    *,
    cluster: Cluster | None = None,
    provider=None,
    resume: bool = True,
    log: Log = print,
    timeout_s: float | None = None,
    rules: XTunerRecovery | None = None,
    clock: Callable[[], float] = time.time,
) -> Trained:
    """Train; on a failure re-run preflight on the nodes (when there is a provider), classify it, decide
    (`decide`: reacquire through the provider, which excludes bad nodes and adds spares; re-render for a new
    world size; ready the nodes) and resume from XTuner's last checkpoint. When recovery gives up, raise an
    XTunerLaunchError naming the reason, carrying the interruptions (`.events`) for the ledger."""
    rules = rules or XTunerRecovery()
    run = _Recovering(plan, cluster, provider, rules, log, clock, rec.RecoveryAccount(rules.budget))
    while True:
        log_file = Path(run.plan.log_dir) / "train.log"
        seen = log_file.stat().st_size if log_file.exists() else 0
        watch = StepWatch(log, clock, StartupDump(log_file))
        try:
            ckpt = _launch_once(
                run.plan,
                cluster=run.cluster,
                provider=provider,
                resume=resume or run.account.relaunches > 0,
                watch=watch,
                startup_timeout_s=run.account.startup_timeout_s(),
                timeout_s=timeout_s,
            )
        except (XTunerLaunchError, TimeoutError) as err:
            run.recover(err, _read_from(log_file, seen), watch)  # ready for the relaunch, or raises
            continue
        return run.finish(ckpt, watch)


@dataclass
class _Recovering:
    """The loop's state between attempts: the plan and nodes of the next one, what recovery has spent."""

    plan: XTunerPlan
    cluster: Cluster | None
    provider: object
    rules: XTunerRecovery
    log: Log
    clock: Callable[[], float]
    account: rec.RecoveryAccount
    aborts: int = 0  # relaunches paid by the gloo abort's own budget

    def recover(self, err: BaseException, text: str, watch: StepWatch) -> None:
        """After a failed attempt: time the open interruption, diagnose, decide; move on to the relaunch, or
        raise the error that says why recovery gave up."""
        account, at = self.account, self.clock()
        failure = _failure(account.relaunches, err, text, watch, at)
        if account.pending is not None:  # the previous interruption: recovered when this attempt logged a step
            rec.close_interruption(account.pending, watch.first_at, at)
            account.charge(at)
        diag = _diagnose(self.provider, self.cluster, failure)
        kind = diag.kind if diag is not None else ("transient" if UPSTREAM_ABORT in text else failure.signal)
        detail = diag.detail if diag is not None else f"{failure.signal}: {failure.cause}"
        when = datetime.fromtimestamp(at, UTC)
        ev = rec.Event(attempt=account.relaunches, kind=kind, detail=detail, at=when, world_before=self.plan.world_size)
        account.events.append(ev)
        current = self.cluster or _this_machine(self.plan)
        bad = diag.bad_nodes if diag is not None else {}
        reacquire = lambda: self._reacquire(current, bad)  # noqa: E731 - called by the rule, only when it relaunches
        decision = decide(failure, diag, text, account, self.aborts, current, self.plan, self.rules, reacquire)
        if isinstance(decision, rec.Relaunch) and self.rules.ready is not None:
            decision = _ready(decision, self.rules.ready)
        if isinstance(decision, rec.GiveUp):
            raise _gave_up(err, ev, decision.reason, account, at, self.clock()) from err
        self.aborts += known_abort(text, diag) and self.aborts < UPSTREAM_ABORT_RETRIES
        self.cluster = decision.cluster if self.cluster is not None else None
        self.plan = decision.plan
        last = find_checkpoint(Path(self.plan.work_dir))
        nodes = ", ".join(n.name for n in self.cluster.nodes) if self.cluster is not None else "this machine"
        ev.world_after = self.plan.world_size
        ev.detail += f"; resumed from {last.name if last else 'the start'} on {nodes}"
        self.log(f"xtuner: recovery {account.relaunches + 1}: {kind}: {detail[:300]}; relaunching on {nodes}")
        account.relaunches += 1
        account.pending = rec.Pending(ev, at, 0.0, 0.0, ev.world_before)

    def _reacquire(self, current: Cluster, bad: dict[str, str]) -> Cluster:
        """The provider's nodes for the relaunch (bad ones excluded, spares added); this machine stays itself."""
        if self.provider is None or self.cluster is None:
            return current
        nxt = self.provider.reacquire(current, bad)
        if self.rules.on_cluster is not None:
            self.rules.on_cluster(nxt)
        return nxt

    def finish(self, checkpoint: Path, watch: StepWatch) -> Trained:
        """The attempt that succeeded: its interruption recovered at its first step (or now, with none to redo)."""
        if self.account.pending is not None:
            rec.close_interruption(self.account.pending, watch.first_at, self.clock(), finished=True)
            self.account.pending = None
        return Trained(checkpoint, self.plan, self.cluster, self.account.events)


def _read_from(log_file: Path, offset: int) -> str:
    """What this attempt appended to the train log."""
    if not log_file.exists():
        return ""
    with open(log_file, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        return f.read()


def _failure(attempt: int, err: BaseException, text: str, watch: StepWatch, at: float) -> rec.AttemptFailure:
    """How the attempt failed: stalled before its first step, or its most telling output line (as native)."""
    if watch.stalled:
        cause = f"no training step logged within {watch.startup_timeout_s:.0f} s of the relaunch (recovery time left)"
    else:
        tail = [x for x in text.splitlines() if x.strip()][-TAIL_LINES:]
        cause = (cause_line(tail, None) if tail else str(err))[-500:]
    return rec.AttemptFailure(attempt, getattr(err, "code", None), watch.stalled, cause, None, at_unix=at)


def _diagnose(provider, cluster: Cluster | None, failure: rec.AttemptFailure) -> rec.Diagnosis | None:
    """Preflight on the failed attempt's nodes, classified (None without a provider: nothing to probe)."""
    if provider is None or cluster is None:
        return None
    try:
        report = provider.preflight(cluster)
    except Exception as e:  # noqa: BLE001 - no report: classified transient, named in the detail
        report = PreflightReport(nodes=[], unknown=f"preflight crashed: {type(e).__name__}: {e}")
    return rec.classify(failure, report)


def _this_machine(plan: XTunerPlan) -> Cluster:
    """The ranks on this machine as a cluster, for the rule (no provider: it never changes)."""
    node = Node(name="this machine", address="127.0.0.1", slots=plan.world_size)
    return Cluster(provider="local", name="this-machine", nodes=[node], master_addr="127.0.0.1", master_port=0)


def _ready(decision: rec.Relaunch, ready: Callable[[Cluster, XTunerPlan], XTunerPlan]) -> rec.Relaunch | rec.GiveUp:
    """The relaunch with its nodes readied, or a GiveUp naming why they cannot be."""
    try:
        return rec.Relaunch(decision.cluster, ready(decision.cluster, decision.plan))
    except ProvisionError as e:  # a new node: no run folder, or its XTuner env failed
        return rec.GiveUp(str(e), decision.cluster)
    except Exception as e:  # noqa: BLE001 - XTunerConfigError (the base model cached elsewhere...): the reason
        return rec.GiveUp(f"no XTuner config for {decision.cluster.world_size} rank(s): {e}", decision.cluster)


def _gave_up(err: BaseException, ev: rec.Event, reason: str, account: rec.RecoveryAccount, at: float, now: float):
    """The error to raise: the reason first, then the last failure; the interruptions ride on it."""
    ev.detail += f"; gave up: {reason}"
    rec.close_interruption(rec.Pending(ev, at, 0.0, 0.0, ev.world_before), None, now)
    out = XTunerLaunchError(f"recovery gave up after {len(account.events)} failure(s): {reason}; last failure: {err}")
    out.code = getattr(err, "code", None)
    out.events = account.events  # the interruptions so far, for the ledger
    return out


# ------------------------------------------------------------------------------------------------ one attempt


class StepWatch:
    """An attempt's output on its way to the log: when it logged its first training step, and whether it was
    ended (`guard`) for logging none within its startup allowance."""

    def __init__(self, log: Log, clock: Callable[[], float] = time.time, dump: StartupDump | None = None):
        self.log, self.clock, self.dump = log, clock, dump  # dump: mmengine's start-up listing, kept out of `log`
        self.first_at: float | None = None
        self.stalled = False
        self.startup_timeout_s: float | None = None
        self._settled = threading.Event()

    def line(self, text: str) -> None:
        for shown in self.dump(text) if self.dump is not None else [text]:
            self.log(shown)
        if self.first_at is None and step_of(text) is not None:
            self.first_at = self.clock()
            self._settled.set()

    def guard(self, timeout_s: float | None, kill: Callable[[], None]) -> None:
        """`kill()` the attempt unless it logs a step within `timeout_s` (None: no limit) or `done()` comes first."""
        self.startup_timeout_s = timeout_s
        if timeout_s is None:
            return

        def wait() -> None:
            if not self._settled.wait(timeout_s):
                self.stalled = True
                kill()

        threading.Thread(target=wait, daemon=True, name="xtuner-startup").start()

    def done(self) -> None:
        self._settled.set()
        for note in self.dump.flush() if self.dump is not None else []:
            self.log(note)


def _launch_once(
    plan: XTunerPlan,
    *,
    cluster: Cluster | None,
    provider,
    resume: bool,
    watch: StepWatch,
    startup_timeout_s: float | None = None,
    timeout_s: float | None = None,
) -> Path:
    """One launch of XTuner's train tool (1 rank, local torchrun, or the provider's nodes); the final checkpoint.
    Raises XTunerLaunchError on a non-zero exit or no checkpoint (XTuner can exit 0 without work)."""
    work_dir = Path(plan.work_dir)
    ckpt = find_checkpoint(work_dir) if resume else None
    if ckpt is not None:
        watch.log(f"xtuner: resuming from {ckpt}")
    log_file = Path(plan.log_dir) / "train.log"
    try:
        if cluster is not None and provider is not None:
            code = _on_nodes(plan, cluster, provider, ckpt, watch, startup_timeout_s, timeout_s, log_file)
        else:
            from nightloom.provision.local import free_port, kill_group

            cmd = train_command(
                plan.python,
                Path(plan.config_path),
                plan.world_size,
                master_port=free_port(),
                resume=ckpt,
                deepspeed=plan.deepspeed,
                distributed=plan.micro_batches > 1,  # one rank accumulating: only the DDP wrapper cuts its batch
            )
            code = run_streaming(
                cmd,
                log_file,
                watch.line,
                step="train",
                timeout_s=timeout_s,
                started=lambda proc: watch.guard(startup_timeout_s, lambda: kill_group(proc)),
            )
    finally:
        watch.done()
    check(code, "train", log_file)
    final = find_checkpoint(work_dir)
    if final is None:
        raise XTunerLaunchError(f"train exited 0 but left no checkpoint in {work_dir}; log: {log_file}")
    return final


def _on_nodes(plan, cluster, provider, ckpt, watch: StepWatch, startup_timeout_s, timeout_s, log_file: Path) -> int:
    """Train on the provider's nodes, each running its XTuner env's interpreter; every line to the log file."""
    nodes = [n.model_copy(update={"python": plan.node_pythons.get(n.name, plan.python)}) for n in cluster.nodes]
    args = train_args(
        Path(plan.config_path), distributed=True, resume=ckpt, deepspeed=plan.deepspeed, wrapper=plan.wrapper
    )
    launch = provider.launch(cluster.model_copy(update={"nodes": nodes}), args, node_env())
    watch.guard(startup_timeout_s, launch.terminate)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a", encoding="utf-8") as f:

        def line(text: str) -> None:
            f.write(text + "\n")
            f.flush()
            watch.line(f"[train] {text}")

        return follow(launch, line, timeout=timeout_s, note=lambda m: watch.log(f"xtuner: {m}"))
