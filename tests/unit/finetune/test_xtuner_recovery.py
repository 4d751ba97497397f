"""XTuner's recovery under nightloom.recovery's rule, without XTuner: the decision for a failed attempt (the gloo
abort's own relaunch, max_attempts, max_minutes, a crash that would repeat, allow_relayout, spares) and the
attempt loop over fake launches with an injected clock. The real runs are tests/xtuner/test_xtuner_recovery.py
and tests/services/test_xtuner_remote.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from nightloom.finetune import attempts
from nightloom.finetune.attempts import UPSTREAM_ABORT, StepWatch, XTunerRecovery, decide, train_with_recovery
from nightloom.finetune.launcher import XTunerLaunchError
from nightloom.finetune.xtuner_plan import XTunerPlan
from nightloom.provision.base import Cluster, Node, NodeReport, PreflightReport
from nightloom.recovery import AttemptFailure, Budget, Diagnosis, GiveUp, RecoveryAccount, Relaunch

NODE = Diagnosis("node", {"n2": "torch: 0.0.1-fake"}, "x")
TRANSIENT = Diagnosis("transient", {}, "x")
ABORT = f"[n1] {UPSTREAM_ABORT}\n"


def failure(code: int, cause: str = "boom") -> AttemptFailure:
    return AttemptFailure(0, code, False, cause, None, at_unix=0.0)


def cluster(*names: str) -> Cluster:
    nodes = [Node(name=n, address="127.0.0.1", slots=1) for n in names]
    return Cluster(provider="ssh", name="c", nodes=nodes, master_addr="127.0.0.1", master_port=1)


def plan(world: int, tmp: Path = Path("/nonexistent")) -> XTunerPlan:
    return XTunerPlan(
        python="python", env_key="k", profile="cpu", method="lora", merge_lora=False, base_model="b",
        run_dir=str(tmp), config_path=str(tmp / "config.py"), work_dir=str(tmp / "work"),
        processed_dir=str(tmp / "p"), log_dir=str(tmp / "logs"), world_size=world, total_steps=8,
        tokens_per_step=1, data_files=[], prepare_key="x",
    )  # fmt: skip


def rule(fail, diag, text="", *, relaunches=0, aborts=0, spent=0.0, attempts_=0, minutes=30.0, nxt=None, **kw):
    """`decide` on a 2-node cluster; `nxt`: what reacquire gives back (default the same nodes)."""
    account = RecoveryAccount(Budget(attempts_, minutes), relaunches=relaunches, spent_s=spent)
    cur = cluster("n1", "n2")
    got: list[Cluster] = []

    def reacquire() -> Cluster:
        got.append(nxt or cur)
        return got[-1]

    d = decide(fail, diag, text, account, aborts, cur, plan(2), XTunerRecovery(account.budget, **kw), reacquire)
    return d, got


def test_the_known_gloo_abort_has_one_relaunch_of_its_own_then_counts_like_any_failure():
    # relaunched once even with recovery.max_attempts = 0, never twice
    assert isinstance(rule(failure(134), None, ABORT)[0], Relaunch)
    d, _ = rule(failure(134), None, UPSTREAM_ABORT, relaunches=1, aborts=1)
    assert isinstance(d, GiveUp) and "gloo abort's own 1" in d.reason
    # past its own budget, a further abort is relaunched within recovery.max_attempts, then not
    assert isinstance(rule(failure(134), TRANSIENT, UPSTREAM_ABORT, relaunches=1, aborts=1, attempts_=3)[0], Relaunch)
    d, _ = rule(failure(134), TRANSIENT, UPSTREAM_ABORT, relaunches=4, aborts=1, attempts_=3)
    assert isinstance(d, GiveUp) and d.reason.startswith("out of attempts: 3 of recovery.max_attempts=3")
    # its budget is its own: a node recovery that used recovery.max_attempts = 1 leaves it a relaunch
    assert isinstance(rule(failure(134), TRANSIENT, UPSTREAM_ABORT, relaunches=1, attempts_=1)[0], Relaunch)
    # an abort on a node preflight now fails is a node failure, within recovery.max_attempts
    d, _ = rule(failure(134), NODE, UPSTREAM_ABORT, relaunches=1, attempts_=1)
    assert isinstance(d, GiveUp) and "out of attempts" in d.reason


def test_what_a_relaunch_can_cure_within_max_attempts():
    # a bad node: relaunched within the budget, on what reacquire gives back
    d, got = rule(failure(1), NODE, attempts_=1, nxt=cluster("n1", "spare"))
    assert isinstance(d, Relaunch) and [n.name for n in d.cluster.nodes] == ["n1", "spare"] and len(got) == 1
    d, got = rule(failure(1), NODE, relaunches=1, attempts_=1)
    assert isinstance(d, GiveUp) and "out of attempts" in d.reason and got == []
    # a killed rank on healthy nodes: relaunched; a plain crash on healthy nodes would repeat: not
    assert isinstance(rule(failure(137), TRANSIENT, attempts_=2)[0], Relaunch)
    d, got = rule(failure(1, "ValueError: bad config"), TRANSIENT, attempts_=2)
    assert isinstance(d, GiveUp) and "would repeat" in d.reason and got == []


def test_max_minutes_spent_stops_relaunching_even_with_attempts_left():
    d, got = rule(failure(137), TRANSIENT, attempts_=5, minutes=1.0, spent=61.0)
    assert isinstance(d, GiveUp) and d.reason.startswith("out of time: 1.0 min spent recovering") and got == []
    # the gloo abort's own relaunch is free of max_attempts, not of max_minutes
    d, _ = rule(failure(134), None, ABORT, minutes=1.0, spent=60.0)
    assert isinstance(d, GiveUp) and "recovery.max_minutes=1" in d.reason
    assert isinstance(rule(failure(134), None, ABORT, minutes=1.0, spent=59.0)[0], Relaunch)


def test_fewer_nodes_need_allow_relayout_and_a_config_for_their_world():
    replanned: list[int] = []

    def replan(world: int) -> XTunerPlan:
        replanned.append(world)
        return plan(world)

    d, _ = rule(failure(1), NODE, attempts_=1, nxt=cluster("n1"), allow_relayout=False, replan=replan)
    assert isinstance(d, GiveUp) and "allow_relayout is false" in d.reason and d.cluster.world_size == 1
    d, _ = rule(failure(1), NODE, attempts_=1, nxt=cluster("n1"), replan=replan)
    assert isinstance(d, Relaunch) and d.plan.world_size == 1 and replanned == [1]
    d, _ = rule(failure(1), NODE, attempts_=1, nxt=cluster("n1"))  # a run that cannot re-render
    assert isinstance(d, GiveUp) and d.reason.startswith("no layout for 1 GPU(s)")
    d, _ = rule(failure(1), NODE, attempts_=1, nxt=cluster("n1"), min_nodes=2, replan=replan)
    assert isinstance(d, GiveUp) and "too few GPUs left" in d.reason
    # a spare keeps the world size: the same config, nothing re-rendered
    d, _ = rule(failure(1), NODE, attempts_=1, nxt=cluster("n1", "spare"), allow_relayout=False, replan=replan)
    assert isinstance(d, Relaunch) and d.plan == plan(2) and replanned == [1]


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


class HealthyNodes:
    """A provider whose preflight passes on every node and whose reacquire keeps them."""

    def __init__(self):
        self.reacquired = 0

    def preflight(self, c: Cluster) -> PreflightReport:
        return PreflightReport(nodes=[NodeReport(node=n.name, ok=True) for n in c.nodes])

    def reacquire(self, c: Cluster, exclude: dict[str, str]) -> Cluster:
        self.reacquired += 1
        return c.model_copy(deep=True)


def test_max_minutes_loop_stops_relaunching_once_time_to_recover_is_spent(tmp_path, monkeypatch):
    """Every attempt logs its first step 2 minutes after it starts (the clock is injected), then a rank is
    killed. With max_minutes 5 and 10 attempts allowed: relaunched after failures 1-3 (0, 2, 4 minutes spent
    recovering), and failure 4 (6 minutes) stops the run: the time is spent though attempts remain. Each
    relaunch had the time left to log its first step."""
    clock, launches = Clock(1_000.0), []
    p = plan(2, tmp_path)
    Path(p.log_dir).mkdir(parents=True)

    def launch(plan, *, cluster, provider, resume, watch: StepWatch, startup_timeout_s=None, timeout_s=None):
        launches.append((resume, startup_timeout_s))
        clock.t += 120.0  # startup
        watch.line("[train] 11/29 22:00:18 - mmengine - INFO - Iter(train) [ 3/8]  lr: 1.0e-03  loss: 5.7")
        clock.t += 30.0
        with open(Path(plan.log_dir) / "train.log", "a") as f:
            f.write("[n2] traceback : Signal 9 (SIGKILL) received by PID 7\n")
        err = XTunerLaunchError("train failed with exit code 1")
        err.code = 1
        raise err

    monkeypatch.setattr(attempts, "_launch_once", launch)
    provider, held = HealthyNodes(), []
    rules = XTunerRecovery(Budget(max_attempts=10, max_minutes=5.0), on_cluster=held.append)
    with pytest.raises(XTunerLaunchError, match=r"gave up after 4 failure\(s\): out of time: 6\.0 min") as e:
        train_with_recovery(p, cluster=cluster("n1", "n2"), provider=provider, resume=False, log=lambda s: None,
                            rules=rules, clock=clock)  # fmt: skip
    assert launches == [(False, None), (True, 300.0), (True, 180.0), (True, 60.0)]
    events = e.value.events
    assert [ev.recovery_s for ev in events] == [120.0, 120.0, 120.0, None]
    assert all(ev.kind == "transient" and "killed" in ev.detail for ev in events), [ev.detail for ev in events]
    assert "gave up: out of time" in events[-1].detail and provider.reacquired == len(held) == 3
    assert e.value.code == 1


def test_a_relaunch_that_logs_no_step_in_the_time_left_is_ended_as_a_stall():
    """StepWatch: a step line settles it; none within the allowance calls kill and marks the attempt stalled."""
    import threading

    killed = threading.Event()
    quiet = StepWatch(lambda s: None)
    quiet.guard(0.05, killed.set)
    assert killed.wait(5) and quiet.stalled and quiet.first_at is None
    killed.clear()
    said: list[str] = []
    busy = StepWatch(said.append, Clock(7.0))
    busy.guard(0.3, killed.set)
    busy.line("[train@n1] Iter(train) [ 1/4]  lr: 1.0e-05  loss: 6.1")
    assert not killed.wait(0.6) and not busy.stalled and busy.first_at == 7.0 and len(said) == 1
