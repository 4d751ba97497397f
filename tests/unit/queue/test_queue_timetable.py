"""The night queue's plan (issue 42): jobs packed onto a queue's nodes inside its windows by priority, split jobs
across nights, wait jobs in one window, deadlines met or flagged with the reason, nightly budgets, the same answer
twice. Every plan is asked at an injected time."""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from nightloom.queue.jobs import QueuedJob
from nightloom.queue.timetable import QueuePlan, plan_queue
from nightloom.schedule.errors import ScheduleError
from nightloom.schedule.windows import windows_between
from nightloom.spec import ScheduleSpec

SH = ZoneInfo("Asia/Shanghai")
H = 3600.0
PRICE, DISCOUNT, GPUS_PER_NODE = 2.5, 0.18, 8
AT = datetime(2026, 6, 1, 0, 0, tzinfo=SH)  # before the first 02:00–06:00 window


def sched(**kw) -> ScheduleSpec:
    base = {"timezone": "Asia/Shanghai", "windows": [{"start": "02:00", "end": "06:00"}], "policy": "split"}
    return ScheduleSpec.model_validate(base | {"price_per_gpu_hour": PRICE, "offpeak_discount": DISCOUNT} | kw)


def job(id, nodes, hours, policy, priority=1, deadline=None, steps=100, prov=600.0, ckpt=40.0, **kw) -> QueuedJob:
    return QueuedJob(
        id=id,
        name=f"job{id}",
        priority=priority,
        nodes=nodes,
        gpus=nodes * GPUS_PER_NODE,
        policy=policy,
        steps=steps,
        step_time_s=hours * H / steps,
        provisioning_s=prov,
        checkpoint_s=ckpt,
        restore_s=ckpt,
        hours_source="given",
        spec_hash=f"h{id}",
        schedule=sched(policy=policy),
        deadline=deadline,
        **kw,
    )


def scenario() -> list[QueuedJob]:
    """The issue's three jobs in a 4-node queue: 4 nodes × 3 h at priority 1; 2 nodes × 6 h split; 2 nodes × 2 h
    wait, with a deadline (the end of the second night) it can meet."""
    return [
        job(1, 4, 3.0, "wait", priority=1),
        job(2, 2, 6.0, "split", priority=2),
        job(3, 2, 2.0, "wait", priority=2, deadline=datetime(2026, 6, 2, 6, 0, tzinfo=SH)),
    ]


def by_id(plan: QueuePlan) -> dict:
    return {j.job.id: j for j in plan.jobs}


def stretches(planned) -> list[list]:
    """A job's segments grouped into stretches (each starts with its provisioning)."""
    out: list[list] = []
    for s in planned.segments:
        if s.what == "provisioning":
            out.append([])
        out[-1].append(s)
    return out


def assert_valid(plan: QueuePlan, s: ScheduleSpec, jobs: list[QueuedJob]) -> None:
    """Never more than max_nodes, disjoint nodes, every segment inside a window, each job's training hours."""
    assert max(held for _, held in plan.nodes_held()) <= plan.max_nodes
    segs = [(j.job.id, g) for j in plan.jobs for g in j.segments]
    for i, (a, ga) in enumerate(segs):
        for b, gb in segs[i + 1 :]:
            if a != b and ga.start < gb.end and gb.start < ga.end:
                assert not set(ga.nodes) & set(gb.nodes), (a, b, ga, gb)
    wins = windows_between(s, AT, AT + timedelta(days=30))
    for _, g in segs:
        assert any(w.start <= g.start and g.end <= w.end for w in wins), g
        assert all(0 <= n < plan.max_nodes for n in g.nodes)
    for j in plan.jobs:
        if j.scheduled:
            train = sum(g.seconds for g in j.segments if g.what == "training")
            assert train == pytest.approx(j.job.training_s)
            for st in stretches(j):  # a stretch is contiguous, on one set of nodes
                assert all(x.end == y.start for x, y in zip(st, st[1:]))
                assert len({g.nodes for g in st}) == 1 and len(st[0].nodes) == j.job.nodes


def test_the_issue_scenario():
    s, jobs = sched(), scenario()
    plan = plan_queue(s, 4, jobs, AT)
    assert_valid(plan, s, jobs)
    p = by_id(plan)
    # priority 1 first: it starts at the first window's start, before or with everyone else
    assert p[1].start == datetime(2026, 6, 1, 2, 0, tzinfo=SH)
    assert p[1].start == min(j.start for j in plan.jobs)
    assert [j.job.id for j in plan.jobs] == [1, 3, 2]  # priority, then deadline, then order added
    # the wait job is one stretch (provisioning, then training) in one window, and meets its deadline
    (wait,) = stretches(p[3])
    assert [g.what for g in wait] == ["provisioning", "training"]
    assert p[3].meets_deadline is True and p[3].finish <= p[3].job.deadline and p[3].reason == ""
    # the split job spans nights: every stretch after the first restores; every one but the last checkpoints
    split = stretches(p[2])
    assert len(split) >= 2 and len({st[0].start.date() for st in split}) == len(split)
    assert [g.what for g in split[0]] == ["provisioning", "training", "checkpoint"]
    assert all(st[1].what == "restore" for st in split[1:])
    assert all(st[-1].what == "checkpoint" for st in split[:-1]) and split[-1][-1].what == "training"
    # side by side: on the second night the 2-node jobs run at once on the 4 nodes
    night2 = datetime(2026, 6, 2, 2, 0, tzinfo=SH)
    assert p[3].start == night2 and any(st[0].start == night2 for st in split)
    # every segment at the off-peak rate of its job's GPUs
    for j in plan.jobs:
        for g in j.segments:
            assert g.cost == pytest.approx(g.seconds * j.job.gpus * PRICE * (1 - DISCOUNT) / H)
    assert plan.cost == pytest.approx(sum(n.cost for n in plan.nights))
    assert [n.start.astimezone(SH).day for n in plan.nights] == [1, 2, 3]
    assert p[1].meets_deadline is None and p[2].meets_deadline is None  # no deadline: nothing to meet


def test_the_same_answer_twice_and_in_any_order_of_asking():
    s, jobs = sched(), scenario()
    first = plan_queue(s, 4, jobs, AT)
    assert plan_queue(s, 4, jobs, AT) == first
    shuffled = jobs[:]
    random.Random(7).shuffle(shuffled)
    again = plan_queue(s, 4, shuffled, AT)
    assert again == first and again.to_json() == first.to_json()


def test_json_has_the_issue_keys():
    out = plan_queue(sched(), 4, scenario(), AT).to_json()
    assert set(out) == {"jobs", "nights"}
    for j in out["jobs"]:
        keys = {"id", "name", "priority", "nodes", "hours", "deadline", "finish", "meets_deadline", "cost", "segments"}
        assert set(j) == keys | {"reason"}
        for g in j["segments"]:
            assert set(g) == {"start", "end", "what", "nodes", "cost"}
            assert datetime.fromisoformat(g["start"]).utcoffset() == timedelta(hours=8)  # the queue's zone
    assert all(set(n) == {"start", "end", "cost", "budget"} for n in out["nights"])
    assert out["jobs"][0]["segments"][0]["nodes"] == [0, 1, 2, 3]


def test_a_deadline_that_cannot_be_met_is_flagged_with_the_reason():
    s = sched()
    first_night_end = datetime(2026, 6, 1, 6, 0, tzinfo=SH)
    jobs = [job(1, 4, 3.0, "wait"), job(2, 2, 2.0, "wait", priority=2, deadline=first_night_end)]
    p = by_id(plan_queue(s, 4, jobs, AT))
    assert p[2].finish > first_night_end and p[2].meets_deadline is False
    assert "higher priority" in p[2].reason and "alone it would finish 2026-06-01 04:10" in p[2].reason
    # alone it could not either: 3 h of training before 03:00 on the first night
    early = datetime(2026, 6, 1, 3, 0, tzinfo=SH)
    alone = by_id(plan_queue(s, 4, [job(5, 1, 3.0, "split", deadline=early)], AT))[5]
    assert alone.meets_deadline is False and alone.reason.startswith("even alone on the queue it finishes")
    past = by_id(plan_queue(s, 4, [job(6, 1, 1.0, "wait", deadline=AT - timedelta(hours=1))], AT))[6]
    assert past.meets_deadline is False and "already past" in past.reason


def test_a_wait_job_longer_than_any_window_is_unschedulable_and_others_still_run():
    s = sched()
    jobs = [job(1, 2, 4.5, "wait", deadline=datetime(2026, 6, 9, tzinfo=SH)), job(2, 2, 1.0, "wait", priority=2)]
    plan = plan_queue(s, 4, jobs, AT)
    p = by_id(plan)
    assert not p[1].scheduled and p[1].finish is None and p[1].cost == 0 and p[1].meets_deadline is False
    assert "longer than any window (4.00 h): it never fits; give it policy split" in p[1].reason
    assert p[2].scheduled and p[2].start == datetime(2026, 6, 1, 2, 0, tzinfo=SH)
    out = plan.to_json()["jobs"][0]
    assert out["segments"] == [] and out["finish"] is None and out["reason"] == p[1].reason
    # as a split job it runs, over two nights
    split = by_id(plan_queue(s, 4, [jobs[0].model_copy(update={"policy": "split"})], AT))[1]
    assert len(stretches(split)) == 2 and split.meets_deadline is True


def test_never_more_than_max_nodes_with_many_jobs():
    s = sched(windows=[{"start": "22:00", "end": "02:00"}, {"start": "03:00", "end": "06:00"}])
    rng = random.Random(42)
    jobs = [
        job(
            i, rng.choice([1, 2, 3]), rng.choice([0.5, 1.0, 2.5, 5.0]), rng.choice(["wait", "split"]), rng.randint(1, 3)
        )
        for i in range(1, 13)
    ]
    jobs = [
        j.model_copy(update={"policy": "split"}) if j.hours > 2.5 else j for j in jobs
    ]  # a 3 h window: 5 h must split
    plan = plan_queue(s, 3, jobs, AT)
    assert all(j.scheduled for j in plan.jobs)
    assert_valid(plan, s, jobs)
    assert [j.job.order() for j in plan.jobs] == sorted(j.order() for j in jobs)


def test_a_job_wider_than_the_queue_is_flagged():
    p = by_id(plan_queue(sched(), 4, [job(1, 8, 1.0, "wait")], AT))[1]
    assert not p.scheduled and p.reason == "needs 8 nodes; the queue has 4"


def test_the_nightly_budget_holds_and_a_job_over_it_is_flagged():
    s = sched()
    rate_per_node_h = GPUS_PER_NODE * PRICE * (1 - DISCOUNT)  # 16.4 a node-hour off-peak
    budget = 4 * rate_per_node_h  # four node-hours a night
    jobs = [job(1, 2, 3.0, "split"), job(2, 1, 1.0, "wait", priority=2)]
    plan = plan_queue(s, 4, jobs, AT, budget_per_night=budget)
    assert_valid(plan, s, jobs)
    assert all(n.cost <= budget + 1e-6 and n.budget == budget for n in plan.nights)
    assert len(stretches(by_id(plan)[1])) >= 2  # the budget, not the window, ends its first night
    big = by_id(plan_queue(s, 4, [job(3, 4, 2.0, "wait")], AT, budget_per_night=budget))[3]
    assert not big.scheduled and "over the queue's budget per night" in big.reason


def test_inside_a_window_the_first_job_starts_at_once():
    at = datetime(2026, 6, 1, 3, 0, tzinfo=SH)
    p = by_id(plan_queue(sched(), 4, [job(1, 2, 2.0, "wait"), job(2, 2, 2.5, "wait"), job(3, 2, 3.0, "wait")], at))
    assert p[1].start == p[2].start == at and p[1].finish == at + timedelta(hours=2, minutes=10)
    assert p[3].start == datetime(2026, 6, 2, 2, 0, tzinfo=SH)  # 3 h 10 does not fit what is left tonight


def test_a_split_job_does_not_rent_for_a_gap_shorter_than_its_overhead():
    s = sched()
    jobs = [job(1, 4, 3.7, "wait", prov=0.0), job(2, 2, 2.0, "split", priority=2)]
    p = by_id(plan_queue(s, 4, jobs, AT))
    # 18 minutes are left after the first job: less than 10 min provisioning + checkpoint worth of training
    assert p[2].start == datetime(2026, 6, 2, 2, 0, tzinfo=SH)


def test_refusals_of_the_plan_itself():
    with pytest.raises(ScheduleError, match="at must be timezone-aware"):
        plan_queue(sched(), 4, [], datetime(2026, 6, 1))
    with pytest.raises(ScheduleError, match="at least one window"):
        plan_queue(sched(windows=[]), 4, [], AT)
    with pytest.raises(ScheduleError, match="max_nodes"):
        plan_queue(sched(), 0, [], AT)
    empty = plan_queue(sched(), 4, [], AT)
    assert empty.jobs == () and empty.nights == () and empty.to_json() == {"jobs": [], "nights": []}


def test_gantt_chart_is_a_png(tmp_path):
    from nightloom.queue.gantt import plot_queue_gantt

    plan = plan_queue(sched(), 4, scenario(), AT)
    out = plot_queue_gantt(plan, tmp_path / "g" / "gantt.png", title="queue team")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["gantt.png"]  # written atomically: no temp file left
