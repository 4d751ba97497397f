"""One night of a night queue (issue 42, item 3): what is left of a job after its nights, which stretches of the plan
are tonight's (side by side on disjoint nodes, or after the stretch that holds their nodes), and what a night's
outcome makes of a job (done, continues split, planned again)."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from nightloom.queue.jobs import QueuedJob
from nightloom.queue.timetable import plan_queue
from nightloom.queue.tonight import (
    JobProgress,
    next_night,
    night_outcome,
    placement,
    remaining,
    tonight,
    tonight_window,
)
from nightloom.spec import ClusterSpec, DatasetSpec, RunSpec, ScheduleSpec, SlurmSpec

SH = ZoneInfo("Asia/Shanghai")
H = 3600.0
SCHED = ScheduleSpec.model_validate(
    {"timezone": "Asia/Shanghai", "windows": [{"start": "02:00", "end": "06:00"}], "policy": "split"}
)


def job(id, nodes, hours, policy="split", priority=1, steps=100) -> QueuedJob:
    return QueuedJob(
        id=id,
        name=f"job{id}",
        priority=priority,
        nodes=nodes,
        gpus=nodes,
        policy=policy,
        steps=steps,
        step_time_s=hours * H / steps,
        provisioning_s=600.0,
        checkpoint_s=40.0,
        restore_s=40.0,
        hours_source="given",
        spec_hash=f"h{id}",
        schedule=SCHED.model_copy(update={"price_per_gpu_hour": 2.0, "offpeak_discount": 0.5, "policy": policy}),
    )


def test_remaining_steps_a_restore_and_done_jobs_leave_the_plan():
    j = job(1, 2, 6.0)
    assert remaining(j, None) == j
    assert remaining(j, JobProgress(1)) == j  # queued, never trained: no restore
    left = remaining(j, JobProgress(1, steps_done=60, run_id="r", status="split"))
    assert (left.steps, left.provisioning_s, left.step_time_s) == (40, 640.0, j.step_time_s)
    failed = remaining(j, JobProgress(1, steps_done=60, run_id="r", status="queued"))  # planned again from step 60
    assert failed.steps == 40
    assert remaining(j, JobProgress(1, steps_done=100, status="split")) is None
    assert remaining(j, JobProgress(1, steps_done=10, status="done")) is None


def test_tonight_picks_the_window_of_at_and_its_stretches_side_by_side():
    # two 1-node jobs on a 2-node queue: both start at 02:00 on nodes 0 and 1; the 6 h one splits over two nights
    plan = plan_queue(
        SCHED, 2, [job(1, 1, 6.0), job(2, 1, 1.0, policy="wait", priority=2)], datetime(2026, 6, 1, 1, 0, tzinfo=SH)
    )
    at = datetime(2026, 6, 1, 2, 0, tzinfo=SH)
    win = tonight_window(SCHED, at)
    assert win.start == at and win.end == at + timedelta(hours=4)
    st = tonight(plan, win)
    assert [(s.job_id, s.nodes, s.after) for s in st] == [(1, (0,), ()), (2, (1,), ())]
    assert st[0].checkpoints and not st[1].checkpoints  # the split job checkpoints at the window's end
    assert st[0].start == st[1].start == at
    assert st[0].training_s == 63 * 216.0  # whole steps of 216 s in 4 h less provisioning and checkpoint
    # the second night holds only job 1's last stretch, with its restore
    win2 = tonight_window(SCHED, at + timedelta(days=1, hours=1))
    (s2,) = tonight(plan, win2)
    assert (s2.job_id, s2.parts) == (1, ("provisioning", "restore", "training"))
    # outside every window: nothing tonight, and the next night is named
    noon = datetime(2026, 6, 1, 12, 0, tzinfo=SH)
    assert tonight_window(SCHED, noon) is None
    assert next_night(SCHED, noon).start == datetime(2026, 6, 2, 2, 0, tzinfo=SH)


def test_a_stretch_on_nodes_an_earlier_one_holds_waits_for_it():
    # 2 nodes: job 1 takes both for 1 h, job 2 (1 node, 1 h) follows on a node job 1 held
    plan = plan_queue(
        SCHED, 2, [job(1, 2, 1.0, "wait"), job(2, 1, 1.0, "wait", priority=2)], datetime(2026, 6, 1, 1, 0, tzinfo=SH)
    )
    st = tonight(plan, tonight_window(SCHED, datetime(2026, 6, 1, 2, 0, tzinfo=SH)))
    assert [s.job_id for s in st] == [1, 2]
    assert st[1].after == (1,) and st[1].start == st[0].end


def test_a_nights_outcome_makes_a_job_done_split_or_planned_again():
    assert night_outcome("completed", 100, 100).status == "done"
    assert night_outcome("split", 60, 100).status == "split"
    assert night_outcome("stopped", 60, 100).status == "split"
    for status in ("failed", "deferred", "refused", None):
        out = night_outcome(status, 30, 100)
        assert out.status == "queued" and out.replanned, out
    assert "crashed" in night_outcome(None, 30, 100).reason
    assert night_outcome("split", 100, 100).status == "done"  # the last steps done at the window's end


def slurm_spec(**slurm) -> RunSpec:
    return RunSpec(
        name="q",
        dataset=DatasetSpec(path="/tmp"),
        cluster=ClusterSpec(name="ci", provider="slurm", nodes=1, slurm=SlurmSpec(partition="debug", **slurm)),
    )


def test_a_stretch_is_placed_on_its_nodes_with_its_own_lock_and_stop():
    plan = plan_queue(
        SCHED, 2, [job(1, 1, 6.0), job(2, 1, 1.0, policy="wait", priority=2)], datetime(2026, 6, 1, 1, 0, tzinfo=SH)
    )
    split, last = tonight(plan, tonight_window(SCHED, datetime(2026, 6, 1, 2, 0, tzinfo=SH)))
    spec = slurm_spec()
    a, b = placement(spec, split, ["n1", "n2"]), placement(spec, last, ["n1", "n2"])
    # one cluster.name, disjoint nodes: two lock keys, so the pipeline's per-cluster lock lets them run at once
    assert (a.lock_key, b.lock_key) == ("ci-nodes-0", "ci-nodes-1")
    # both keep the gate's deadline: the split one ends with the window (short of it by less than a step)
    assert split.train_end == split.end - timedelta(seconds=40) and a.stop_at is None and b.stop_at is None
    # pinned to the partition's nodes at the plan's indices, in the provider's spec only (the run's hash is kept)
    assert (a.extra_sbatch, b.extra_sbatch, b.pinned) == (("--nodelist=n1",), ("--nodelist=n2",), ("n2",))
    rent = b.provider_spec(spec)
    assert rent.cluster.provider.extra_sbatch == ["--nodelist=n2"] and spec.cluster.provider.extra_sbatch == []
    # not pinned, each with the reason: unknown nodes, too few, the spec chooses its own, an excluded node, local
    assert "not known" in placement(spec, last, None).note and not placement(spec, last, None).extra_sbatch
    assert "fewer than the queue's node 1" in placement(spec, last, ["n1"]).note
    own = placement(slurm_spec(extra_sbatch=["--nodelist=n9"]), last, ["n1", "n2"])
    assert not own.extra_sbatch and "--nodelist=n9" in own.note
    assert "exclude" in placement(slurm_spec(exclude=["n2"]), last, ["n1", "n2"]).note
    local = placement(RunSpec(name="q", dataset=DatasetSpec(path="/tmp")), last, None)
    assert local.extra_sbatch == () and local.lock_key == "local-nodes-1" and "local provider" in local.note


def test_a_stretch_the_plan_ends_before_the_window_stops_at_its_checkpoint():
    # 1 GPU-hour costs 1.0 off-peak: a budget of 2.0 a night cuts the 6 h job's stretch near 04:00, not at 06:00
    at = datetime(2026, 6, 1, 2, 0, tzinfo=SH)
    plan = plan_queue(SCHED, 1, [job(1, 1, 6.0)], at, 2.0)
    win = tonight_window(SCHED, at)
    (s,) = tonight(plan, win)
    assert s.checkpoints and (win.end - s.end).total_seconds() >= 216.0
    assert s.stop_at == s.train_end == s.end - timedelta(seconds=40)
    assert placement(slurm_spec(), s, ["n1"]).stop_at == s.stop_at


def test_prefect_yaml_runs_the_queue_at_the_windows_start():
    import inspect
    from pathlib import Path

    import yaml

    from flows.queue_night import nightly_queue

    root = Path(__file__).resolve().parents[3]
    (dep,) = [
        d for d in yaml.safe_load((root / "prefect.yaml").read_text())["deployments"] if d["name"] == "nightly-queue"
    ]
    assert dep["entrypoint"] == "flows/queue_night.py:nightly_queue"
    (cron,) = dep["schedules"]
    assert (cron["cron"], cron["timezone"]) == ("0 2 * * *", "Asia/Shanghai")  # the 02:00-06:00 window's start
    assert set(dep["parameters"]) <= set(inspect.signature(nightly_queue.fn).parameters)
