"""The recovery loop's pure parts: the next-attempt decision, interruption timing, the loop state, Cluster.union.

The flow-level recovery tests (tests/flows/test_recovery.py) run them with real processes; these need none.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from nightloom.parallel import ParallelPlan
from nightloom.provision.base import Cluster, Node
from nightloom.recovery import (
    Budget,
    Event,
    GiveUp,
    Pending,
    RecoveryState,
    Relaunch,
    close_interruption,
    next_attempt,
    recovery_summary,
)


def cluster(*names: str, slots: int = 2, addr: str = "10.0.0.{}") -> Cluster:
    nodes = [Node(name=n, address=addr.format(i), slots=slots) for i, n in enumerate(names)]
    return Cluster(provider="test", name="c", nodes=nodes, master_addr=nodes[0].address, master_port=29500)


def plan(world: int) -> ParallelPlan:
    return ParallelPlan(tp=1, pp=1, dp_replicate=1, dp_shard=world, micro_batch=1, grad_accum=8 // world)


class Calls:
    """reacquire/replan stand-ins that count their calls."""

    def __init__(self, nxt: Cluster, replan_error: Exception | None = None):
        self.nxt, self.err, self.reacquired, self.replanned = nxt, replan_error, 0, []

    def reacquire(self) -> Cluster:
        self.reacquired += 1
        return self.nxt

    def replan(self, world: int) -> ParallelPlan:
        self.replanned.append(world)
        if self.err is not None:
            raise self.err
        return plan(world)


def decide(calls: Calls, relaunches=0, spent=0.0, min_nodes=1, allow_relayout=True, budget=None):
    cur = cluster("a", "b")
    return next_attempt(
        budget or Budget(2, 10),
        relaunches,
        spent,
        cur,
        plan(4),
        min_nodes=min_nodes,
        allow_relayout=allow_relayout,
        reacquire=calls.reacquire,
        replan=calls.replan,
    )


def test_same_size_relaunches_on_the_same_plan_without_replanning():
    calls = Calls(cluster("a", "c"))
    d = decide(calls)
    assert isinstance(d, Relaunch) and d.plan == plan(4) and [n.name for n in d.cluster.nodes] == ["a", "c"]
    assert calls.reacquired == 1 and calls.replanned == []


def test_a_smaller_cluster_is_replanned():
    calls = Calls(cluster("a"))
    d = decide(calls)
    assert isinstance(d, Relaunch) and d.plan == plan(2) and calls.replanned == [2]


def test_a_spent_budget_gives_up_before_reacquiring():
    calls = Calls(cluster("a", "b"))
    d = decide(calls, relaunches=2)
    assert isinstance(d, GiveUp) and d.reason.startswith("out of attempts") and d.cluster is None
    d = decide(calls, spent=600.0)
    assert isinstance(d, GiveUp) and d.reason.startswith("out of time")
    assert calls.reacquired == 0


def test_too_few_nodes_or_no_relayout_give_up_with_the_reacquired_nodes():
    calls = Calls(cluster("a"))
    d = decide(calls, min_nodes=2)
    assert isinstance(d, GiveUp) and "too few GPUs left" in d.reason and d.cluster is calls.nxt
    d = decide(calls, allow_relayout=False)
    assert isinstance(d, GiveUp) and "allow_relayout is false" in d.reason and d.cluster is calls.nxt
    assert calls.replanned == []


def test_no_layout_for_the_new_size_gives_up_naming_the_error():
    calls = Calls(cluster("a"), replan_error=ValueError("tp=4 does not divide 2"))
    d = decide(calls)
    assert isinstance(d, GiveUp) and d.reason == "no layout for 2 GPU(s): ValueError: tp=4 does not divide 2"
    assert d.cluster is calls.nxt


def event() -> Event:
    return Event(attempt=0, kind="node", detail="rank died", at=datetime(2026, 1, 1, tzinfo=UTC))


def test_close_interruption_times_recovery_and_time_lost():
    e = close_interruption(Pending(event(), 100.0, silent_s=5.0, redone_s=7.0, gpus=4), 130.0, now_unix=200.0)
    assert e.recovery_s == 30.0 and e.lost_s == 42.0 and e.detail == "rank died"
    # finished with nothing to redo: recovered when it finished
    e = close_interruption(Pending(event(), 100.0, 0.0, 0.0, 4), None, now_unix=110.0, finished=True)
    assert e.recovery_s == 10.0 and e.lost_s == 10.0
    # never reported a step: not recovered, all time until now lost
    e = close_interruption(Pending(event(), 100.0, 2.0, 0.0, 4), None, now_unix=150.0)
    assert e.recovery_s is None and e.lost_s == 52.0 and e.detail.endswith("; not recovered")


def test_recovery_state_counts_spent_time_and_advances_the_job():
    from nightloom.catalog import get_model
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    job = TrainJob(
        run_id="r",
        run_dir="/tmp/r",
        model=(get_model("tiny")),
        plan=plan(4),
        train=TrainSpec(),
        manifest="/tmp/m",
    )
    first = cluster("a", "b")
    st = RecoveryState(Budget(3, 1), cluster=first, job=job, seen=first, started=0.0)
    assert st.startup_timeout_s() is None  # the first attempt has the normal startup allowance
    nxt = cluster("a")
    st.advance(Relaunch(nxt, plan(2)), Pending(event(), 100.0, 0.0, 0.0, 4))
    assert st.relaunches == 1 and st.cluster is nxt and st.job.plan == plan(2)
    assert st.job.attempt == 1 and st.job.resume and job.attempt == 0
    assert st.startup_timeout_s() == 60.0
    st.pending.event.recovery_s = 15.0
    st.charge(failed_at_unix=500.0)
    assert st.spent_s == 15.0 and st.pending is None and st.startup_timeout_s() == 45.0
    st.pending = Pending(event(), 100.0, 0.0, 0.0, 4)  # never recovered: charged until the next failure
    st.charge(failed_at_unix=130.0)
    assert st.spent_s == 45.0
    st.spent_s = 100.0
    assert st.startup_timeout_s() == 1.0  # never below a second


def test_recovery_summary_line():
    a, b = event(), event()
    a.recovery_s, b.recovery_s = 10.0, None
    assert recovery_summary([a, b], 3600.0) == (
        "2 interruption(s) in 3600 s of training: 2.00/h; mean time to recover 10.0 s"
    )
    assert recovery_summary([], 0.0).endswith("0.00/h; mean time to recover -")


def test_cluster_union_keeps_the_new_clusters_fields_and_every_node():
    old, new = cluster("a", "b"), cluster("a", "c", addr="10.0.1.{}")
    u = old.union(new)
    assert [n.name for n in u.nodes] == ["a", "c", "b"] and u.master_addr == new.master_addr
    assert [n.name for n in old.nodes] == ["a", "b"]  # unchanged


@pytest.mark.parametrize("drop, master", [({"b": "gpu"}, "10.0.0.0"), ({"a": "gpu"}, "10.0.0.1")])
def test_cluster_without_moves_the_rendezvous_off_a_dropped_node(drop, master):
    c = cluster("a", "b")
    out = c.without(drop)
    assert [n.name for n in out.nodes] == [n for n in ("a", "b") if n not in drop]
    assert out.master_addr == master and out.excluded == drop and c.excluded == {}


def test_every_provider_and_launch_has_the_whole_protocol():
    """Callers use `provider.reacquire`, `provider.last_report` and `launch.pids` directly (no getattr probing)."""
    import inspect

    from nightloom.provision.base import Launch, Provider
    from nightloom.provision.k8s import KubernetesLaunch, KubernetesProvider
    from nightloom.provision.local import LocalProvider, ProcessLaunch
    from nightloom.provision.slurm import SlurmLaunch, SlurmProvider
    from nightloom.provision.ssh import SSHLaunch, SSHProvider

    def members(proto) -> set[str]:
        return {n for n in vars(proto) if not n.startswith("_")} | set(proto.__annotations__)

    for cls in (LocalProvider, SSHProvider, SlurmProvider, KubernetesProvider):
        missing = {m for m in members(Provider) if not hasattr(cls, m)}
        assert not missing and {"reacquire", "last_report"} <= members(Provider), (cls.__name__, missing)
        assert cls.last_report is None  # before any acquire
        assert list(inspect.signature(cls.reacquire).parameters) == ["self", "cluster", "exclude"]
    for cls in (ProcessLaunch, SSHLaunch, SlurmLaunch, KubernetesLaunch):
        missing = {m for m in members(Launch) if not hasattr(cls, m)}
        assert not missing and "pids" in members(Launch), (cls.__name__, missing)
