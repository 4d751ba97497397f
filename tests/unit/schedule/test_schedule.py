"""Off-peak window decisions with an injected clock, window cost, budgets, rent vs buy."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from nightloom.schedule.budget import budget_check, budget_deadline, check_budget, refuse_if_over
from nightloom.schedule.cost import BillingSpan, cost_of_spans, estimate_cost, lost_time_cost, run_cost
from nightloom.schedule.errors import BudgetExceeded, ScheduleError, TooManyNights
from nightloom.schedule.inputs import inputs_for_spec
from nightloom.schedule.nights import NightInputs, plan_nights
from nightloom.schedule.rent_vs_buy import rent_vs_buy
from nightloom.schedule.windows import current_window, decide, next_window, windows_between
from nightloom.spec import ScheduleSpec, WindowSpec

SH = ZoneInfo("Asia/Shanghai")
NY = ZoneInfo("America/New_York")
H = 3600.0


def sched(policy="wait", start="02:00", end="06:00", tz="Asia/Shanghai", **kw) -> ScheduleSpec:
    return ScheduleSpec(timezone=tz, windows=[WindowSpec(start=start, end=end)], policy=policy, **kw)


def at(y, mo, d, h, mi=0, tz=SH, fold=0) -> datetime:
    return datetime(y, mo, d, h, mi, tzinfo=tz, fold=fold)


# ---------------------------------------------------------------------------------------------- windows


def test_inside_before_after_the_default_window():
    s = sched()
    d = decide(at(2026, 6, 1, 3), s, 1 * H)
    assert d.action == "run" and d.start_at == d.now and d.deadline is None
    assert d.window.start == at(2026, 6, 1, 2) and d.window.end == at(2026, 6, 1, 6)
    d = decide(at(2026, 6, 1, 1, 30), s, 1 * H)
    assert d.action == "wait" and d.start_at == at(2026, 6, 1, 2) and d.wait_s == 1800
    assert "next starts 2026-06-01 02:00 CST" in d.reason
    d = decide(at(2026, 6, 1, 7), s, 1 * H)
    assert d.action == "wait" and d.start_at == at(2026, 6, 2, 2)
    # the end is exclusive, the start inclusive
    assert decide(at(2026, 6, 1, 6), s, 60).action == "wait"
    assert decide(at(2026, 6, 1, 2), s, 60).action == "run"


def test_wait_defers_a_run_that_does_not_fit_what_is_left():
    d = decide(at(2026, 6, 1, 5), sched(), 2 * H)
    assert d.action == "wait" and d.start_at == at(2026, 6, 2, 2) and "does not fit" in d.reason


def test_window_crossing_midnight():
    s = sched(start="22:00", end="02:00")
    d = decide(at(2026, 6, 1, 23, 30), s, 2 * H)
    assert d.action == "run" and d.window.end == at(2026, 6, 2, 2)
    d = decide(at(2026, 6, 2, 1), s, 0.5 * H)  # the window that began yesterday
    assert d.action == "run" and d.window.start == at(2026, 6, 1, 22)
    d = decide(at(2026, 6, 2, 2, 30), s, 0.5 * H)
    assert d.action == "wait" and d.start_at == at(2026, 6, 2, 22)
    d = decide(at(2026, 6, 1, 23), sched("split", start="22:00", end="02:00"), 5 * H)
    assert d.action == "run" and d.deadline == at(2026, 6, 2, 2)


def test_dst_fall_back_night_is_five_real_hours_spring_forward_three():
    s = sched(start="01:00", end="05:00", tz="America/New_York")
    # 2026-11-01: clocks go 02:00 EDT → 01:00 EST; window 01:00 EDT → 05:00 EST is 5 h of real time
    fall = current_window(s, at(2026, 11, 1, 1, 30, tz=NY))
    assert fall.seconds == 5 * H
    assert decide(at(2026, 11, 1, 1, 0, tz=NY), s, 4.5 * H).action == "run"
    # 2026-03-08: clocks go 02:00 EST → 03:00 EDT; the same window is 3 h
    spring = current_window(s, at(2026, 3, 8, 1, 30, tz=NY))
    assert spring.seconds == 3 * H
    d = decide(at(2026, 3, 8, 1, 0, tz=NY), s, 3.5 * H)  # fits a normal 4 h window, not tonight's
    assert d.action == "wait" and d.start_at == at(2026, 3, 9, 1, tz=NY)
    # an ordinary night is 4 h
    assert current_window(s, at(2026, 6, 1, 2, tz=NY)).seconds == 4 * H


def test_dst_nonexistent_start_is_shifted_by_the_jump():
    s = sched(start="02:30", end="04:00", tz="America/New_York")
    nxt = next_window(s, at(2026, 3, 8, 0, 0, tz=NY))
    assert nxt.start == datetime(2026, 3, 8, 7, 30, tzinfo=UTC)  # 02:30 EST == 03:30 EDT
    assert nxt.end == at(2026, 3, 8, 4, 0, tz=NY) and nxt.seconds == 0.5 * H


def test_longer_than_the_window_under_each_policy():
    long = 6 * H
    inside, outside = at(2026, 6, 1, 2), at(2026, 6, 1, 12)
    d = decide(inside, sched("run-now"), long)
    assert d.action == "run" and d.deadline is None and "inside" in d.reason
    assert decide(outside, sched("run-now"), long).action == "run"
    d = decide(inside, sched("wait"), long)
    assert d.action == "run" and d.deadline is None and "longer than any window" in d.reason
    assert decide(outside, sched("wait"), long).start_at == at(2026, 6, 2, 2)
    d = decide(inside, sched("split"), long)
    assert d.action == "run" and d.deadline == at(2026, 6, 1, 6) and "resume in the next window" in d.reason
    d = decide(outside, sched("split"), long)
    assert d.action == "wait" and d.start_at == at(2026, 6, 2, 2) and d.deadline is None


def test_several_windows_merge_and_order():
    s = ScheduleSpec(
        windows=[
            WindowSpec(start="12:00", end="13:00"),
            WindowSpec(start="02:00", end="06:00"),
            WindowSpec(start="06:00", end="07:00"),
        ],
        policy="wait",
    )
    ivs = windows_between(s, at(2026, 6, 1, 0), at(2026, 6, 2, 0))
    assert [(iv.start, iv.end) for iv in ivs] == [
        (at(2026, 6, 1, 2), at(2026, 6, 1, 7)),
        (at(2026, 6, 1, 12), at(2026, 6, 1, 13)),
    ]
    assert decide(at(2026, 6, 1, 5), s, 1.5 * H).action == "run"  # 02–06 and 06–07 are one window
    assert decide(at(2026, 6, 1, 8), s, 0.5 * H).start_at == at(2026, 6, 1, 12)


def test_whole_day_window_and_bad_clock():
    s = sched(start="00:00", end="00:00")
    assert decide(at(2026, 6, 1, 15), s, 30 * H).action == "run"
    with pytest.raises(ScheduleError, match="timezone-aware"):
        decide(datetime(2026, 6, 1, 3), sched(), 60)
    with pytest.raises(ScheduleError, match="needs at least one window"):
        decide(at(2026, 6, 1, 3), ScheduleSpec(windows=[], policy="wait"), 60)


# ---------------------------------------------------------------------------------------------- cost


def test_cost_split_at_the_window_edge_with_provisioning():
    s = sched(price_per_gpu_hour=2.0, offpeak_discount=0.18)
    c = estimate_cost(s, at(2026, 6, 1, 5), 1.5 * H, gpus=8, provisioning_s=0.5 * H)  # bills 05:00–07:00
    assert [(g.offpeak, g.start, g.end) for g in c.segments] == [
        (True, at(2026, 6, 1, 5), at(2026, 6, 1, 6)),
        (False, at(2026, 6, 1, 6), at(2026, 6, 1, 7)),
    ]
    assert c.gpu_hours == pytest.approx(16) and c.offpeak_gpu_hours == pytest.approx(8)
    assert c.cost == pytest.approx(8 * (2.0 * 0.82 + 2.0))
    assert c.currency == "USD"


def test_cost_of_spans_bills_each_span_at_its_own_size_and_window():
    """8 GPUs 05:00–06:00 (off-peak), then a recovery left 4 GPUs 06:00–07:00 (peak)."""
    s = sched(price_per_gpu_hour=2.0, offpeak_discount=0.18)
    spans = [BillingSpan(at(2026, 6, 1, 5), H, 8), BillingSpan(at(2026, 6, 1, 6), H, 4)]
    assert cost_of_spans(s, spans) == pytest.approx(8 * 2.0 * 0.82 + 4 * 2.0)
    # the old way, the final size for the whole time, would bill 4 GPUs for both hours
    assert cost_of_spans(s, spans) > estimate_cost(s, at(2026, 6, 1, 5), 2 * H, gpus=4).cost
    assert cost_of_spans(s, []) == 0.0


def test_cost_over_two_days_and_across_midnight_windows():
    s = sched(start="22:00", end="02:00", price_per_gpu_hour=3.0, offpeak_discount=0.5)
    c = estimate_cost(s, at(2026, 6, 1, 0), 48 * H, gpus=2)
    # off-peak: 00–02 d1, 22–02 d1/d2, 22–24 d2 = 8 h of 48
    assert c.offpeak_gpu_hours == pytest.approx(2 * 8) and c.gpu_hours == pytest.approx(96)
    assert c.cost == pytest.approx(2 * (40 * 3.0 + 8 * 1.5))


def test_budget_refusal_names_both_figures():
    s = sched(price_per_gpu_hour=2.0, budget=100.0)
    check_budget(s, estimate_cost(s, at(2026, 6, 1, 12), 5 * H, gpus=8))  # 80 <= 100
    with pytest.raises(BudgetExceeded, match=r"predicted cost 160.00 USD .* exceeds schedule.budget 100.00"):
        check_budget(s, estimate_cost(s, at(2026, 6, 1, 12), 10 * H, gpus=8))


def test_budget_deadline_for_a_running_job():
    s = sched(price_per_gpu_hour=1.0, offpeak_discount=0.5, budget=2.5)
    # 01–02 peak costs 1.0; then 0.5/h off-peak: 1.5 more takes 3 h → 05:00
    assert budget_deadline(s, at(2026, 6, 1, 1), gpus=1) == at(2026, 6, 1, 5)
    assert budget_deadline(s, at(2026, 6, 1, 1), gpus=1, already_spent=2.0) == at(2026, 6, 1, 1, 30)
    assert budget_deadline(s, at(2026, 6, 1, 1), gpus=1, already_spent=3.0) == at(2026, 6, 1, 1)
    assert budget_deadline(sched(price_per_gpu_hour=1.0), at(2026, 6, 1, 1), gpus=1) is None
    assert budget_deadline(sched(budget=5.0), at(2026, 6, 1, 1), gpus=1) is None  # price 0


def test_budget_deadline_agrees_with_estimate_cost():
    rng = random.Random(7)
    s = sched(start="22:00", end="03:00", price_per_gpu_hour=2.5, offpeak_discount=0.3, budget=400.0)
    for _ in range(10):
        start = at(2026, 6, 1, 0) + timedelta(minutes=rng.randrange(0, 3 * 24 * 60))
        gpus = rng.choice([1, 4, 8])
        dl = budget_deadline(s, start, gpus)
        spent = estimate_cost(s, start, (dl - start).total_seconds(), gpus).cost
        assert spent == pytest.approx(400.0, rel=1e-9)


# ---------------------------------------------------------------------------------------------- rent vs buy


def test_rent_vs_buy_defaults_and_break_even():
    r = rent_vs_buy(gpus=8, gpu_hours_per_month=2000, rent_price_per_gpu_hour=2.0, purchase_price=2_000_000)
    assert r.operations_per_month == 28_000 and r.idle_fraction == 0.37 and r.lead_time_days == (45, 90)
    assert r.rent_per_month == pytest.approx(4000)
    assert r.own_per_month == pytest.approx(2_000_000 / 36 + 28_000)
    assert r.cheaper == "rent"
    assert r.own_useful_gpu_hours == pytest.approx(8 * 730 * 0.63)
    assert r.break_even_gpu_hours_per_month == pytest.approx(r.own_per_month / 2.0)
    assert r.lead_time_rent == pytest.approx((4000 / 730 * 24 * 45, 4000 / 730 * 24 * 90))
    big = rent_vs_buy(gpus=80, gpu_hours_per_month=30_000, rent_price_per_gpu_hour=4.0, purchase_price=1_800_000)
    assert big.cheaper == "buy" and not big.over_capacity
    assert big.break_even_purchase_price == pytest.approx((120_000 - 28_000) * 36)
    assert (
        r.over_capacity is False
        and rent_vs_buy(gpus=1, gpu_hours_per_month=700, rent_price_per_gpu_hour=1.0).over_capacity
    )
    assert rent_vs_buy(gpus=8, gpu_hours_per_month=10, rent_price_per_gpu_hour=2.0).cheaper == "unknown"
    with pytest.raises(ValueError, match="idle_fraction"):
        rent_vs_buy(gpus=8, gpu_hours_per_month=10, rent_price_per_gpu_hour=2.0, idle_fraction=1.0)


# ---------------------------------------------------------------------------------------------- `nightloom cost`


def write_spec(tmp_path, **schedule) -> str:
    import yaml

    spec = {
        "name": "cost-test",
        "model": {"name": "llama2-7b"},
        "dataset": {"path": "data", "sample": True},
        "cluster": {"provider": "slurm", "nodes": 2, "gpus_per_node": 8, "gpu_type": "h100-80gb"},
        "train": {"steps": 100, "seq_len": 4096, "global_batch": 64},
        "schedule": {
            "timezone": "Asia/Shanghai",
            "policy": "wait",
            "price_per_gpu_hour": 2.5,
            "offpeak_discount": 0.18,
            **schedule,
        },
    }
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    return str(p)


def test_cost_cli_json_matches_the_library(tmp_path, capsys):
    import json

    from flows.cli import main

    spec = write_spec(tmp_path, budget=1000.0)
    rc = main(
        [
            "cost",
            spec,
            "--hours",
            "3",
            "--provisioning-min",
            "30",
            "--at",
            "2026-06-01T04:00:00+08:00",
            "--purchase-price",
            "4000000",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["over_budget"] is None
    assert out["decision"]["action"] == "wait"  # 3 h does not fit 04:00–06:00: next night
    s = sched(price_per_gpu_hour=2.5, offpeak_discount=0.18)
    want = estimate_cost(s, at(2026, 6, 2, 2), 3 * H, gpus=16, provisioning_s=1800)
    assert out["cost"]["cost"] == pytest.approx(want.cost) and out["cost"]["gpu_hours"] == pytest.approx(56)
    assert out["rent_vs_buy"]["operations_per_month"] == 28_000 and out["rent_vs_buy"]["cheaper"] == "rent"


def test_cost_cli_budget_refusal_and_usage_errors(tmp_path, capsys):
    from flows.cli import main

    spec = write_spec(tmp_path, budget=50.0)
    assert main(["cost", spec, "--hours", "3", "--at", "2026-06-01T03:00:00+08:00"]) == 1
    err = capsys.readouterr().err
    assert "exceeds schedule.budget 50.00 USD" in err
    assert main(["cost", spec, "--hours", "3", "--at", "2026-06-01T03:00:00"]) == 2
    assert "time zone offset" in capsys.readouterr().err
    assert main(["cost", str(tmp_path / "missing.yaml"), "--hours", "1"]) == 2
    assert "spec file" in (err := capsys.readouterr().err) and "does not exist" in err and "current folder" in err
    cpu = tmp_path / "cpu.yaml"
    # tiny's max_seq is 512: the planner now applies the trainer's seq_len rule too
    text = Path(spec).read_text().replace("h100-80gb", "cpu").replace("llama2-7b", "tiny")
    cpu.write_text(text.replace("seq_len: 4096", "seq_len: 128"))
    assert main(["cost", str(cpu)]) == 2
    assert "give --hours" in capsys.readouterr().err
    # without --hours the planner's predicted step time sets the duration
    assert main(["cost", write_spec(tmp_path), "--at", "2026-06-01T03:00:00+08:00"]) == 0
    assert "planner: " in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- plan of nights


def night_inputs(steps=100, step=60.0, gpus=8, prov=600.0, ckpt=120.0, **kw) -> NightInputs:
    return NightInputs(
        steps=steps,
        gpus=gpus,
        step_time_s=step,
        step_source="planner: test" if step else "none",
        provisioning_s=prov,
        provisioning_source="spec",
        checkpoint_s=ckpt,
        restore_s=ckpt,
        checkpoint_source="test",
        **kw,
    )


def test_split_run_that_fits_one_window():
    s = sched("split", price_per_gpu_hour=2.0)
    p = plan_nights(s, at(2026, 6, 1, 1), night_inputs(steps=100, step=60.0))  # 10 min + 100 min < 4 h
    assert p.complete and p.total_nights == 1 and len(p.nights) == 1
    (n,) = p.nights
    assert n.start == at(2026, 6, 1, 2) and n.ends_run and n.steps == 100
    assert [g.what for g in n.segments] == ["provisioning", "training"]  # no restore, no checkpoint
    assert p.finish == at(2026, 6, 1, 3, 50) and p.local(p.finish) == "2026-06-01 03:50 CST"
    assert p.cost == pytest.approx(8 * 2.0 * 0.82 * (110 / 60))


def test_split_run_of_exactly_n_windows():
    """Each 4 h night: 10 min provisioning, 2 min restore (not the first), 2 min checkpoint; 1-minute steps."""
    s = sched("split", price_per_gpu_hour=1.0, offpeak_discount=0.5)
    first, later = 240 - 10 - 2, 240 - 10 - 2 - 2  # steps per night
    steps = first + 2 * later
    p = plan_nights(s, at(2026, 6, 1, 2), night_inputs(steps=steps, step=60.0, gpus=1))
    assert [n.steps for n in p.nights] == [first, later, later] and p.total_nights == 3
    assert [n.ends_run for n in p.nights] == [False, False, True]
    assert [g.what for g in p.nights[1].segments] == ["provisioning", "restore", "training", "checkpoint"]
    # every night fills its window exactly; the last one needs no window-end checkpoint, so it ends 2 min early
    assert [n.end for n in p.nights] == [at(2026, 6, 1, 6), at(2026, 6, 2, 6), at(2026, 6, 3, 5, 58)]
    assert p.offpeak_gpu_hours == pytest.approx(p.gpu_hours) == pytest.approx(12 - 2 / 60)
    one_more = plan_nights(s, at(2026, 6, 1, 2), night_inputs(steps=steps + 1, step=60.0, gpus=1))
    assert one_more.total_nights == 4 and one_more.nights[-1].steps == 1


def test_split_nights_across_midnight_and_a_dst_change():
    """A 22:00–02:00 window in New York over the fall-back night (2026-10-31 → 11-01): that night is 5 real hours."""
    s = sched("split", start="22:00", end="02:00", tz="America/New_York", price_per_gpu_hour=1.0)
    p = plan_nights(s, at(2026, 10, 30, 21, tz=NY), night_inputs(steps=13, step=H, gpus=1, ckpt=0.0, prov=0.0))
    assert [n.start for n in p.nights] == [at(2026, 10, d, 22, tz=NY) for d in (30, 31)] + [at(2026, 11, 1, 22, tz=NY)]
    assert [n.steps for n in p.nights] == [4, 5, 4]  # the DST night fits one more one-hour step
    assert p.nights[1].window.seconds == 5 * H and p.nights[1].end == at(2026, 11, 1, 2, tz=NY)
    assert p.finish == at(2026, 11, 2, 2, tz=NY) and p.local(p.finish) == "2026-11-02 02:00 EST"
    assert p.local(p.nights[0].end) == "2026-10-31 02:00 EDT"  # each night ends the day after it starts
    assert p.gpu_hours == pytest.approx(13) and p.offpeak_gpu_hours == pytest.approx(13)


def test_split_windows_of_different_lengths():
    s = ScheduleSpec(
        windows=[WindowSpec(start="12:00", end="13:00"), WindowSpec(start="02:00", end="06:00")],
        policy="split",
        price_per_gpu_hour=1.0,
    )
    p = plan_nights(s, at(2026, 6, 1, 1), night_inputs(steps=300, step=60.0, gpus=1, prov=0.0, ckpt=0.0))
    # 240 steps in 02–06, 60 in 12–13
    assert [(n.start, n.steps) for n in p.nights] == [(at(2026, 6, 1, 2), 240), (at(2026, 6, 1, 12), 60)]
    assert p.finish == at(2026, 6, 1, 13)
    # a window too short for provisioning + restore + checkpoint + a step is skipped, the long one used
    q = plan_nights(s, at(2026, 6, 1, 1), night_inputs(steps=480, step=60.0, gpus=1, prov=59.5 * 60, ckpt=0.0))
    assert [n.start.astimezone(SH).hour for n in q.nights] == [2, 2, 2]


def test_split_provisioning_longer_than_a_window_never_fits():
    s = sched("split", start="02:00", end="03:00")
    with pytest.raises(ScheduleError, match="never fits.*longer than any window"):
        plan_nights(s, at(2026, 6, 1, 1), night_inputs(prov=2 * H))
    # what is left of tonight is too short: the plan starts at the next window instead of renting now
    p = plan_nights(sched("split"), at(2026, 6, 1, 5, 55), night_inputs(steps=10))
    assert p.start == at(2026, 6, 2, 2) and "what is left of this window" in p.reason


def test_plan_cost_is_the_sum_of_its_segments():
    s = sched("split", price_per_gpu_hour=1.7, offpeak_discount=0.3)
    p = plan_nights(s, at(2026, 6, 1, 4), night_inputs(steps=700, step=47.0, gpus=16))
    assert len(p.nights) > 2
    segs = [g for n in p.nights for g in n.segments]
    assert p.cost == pytest.approx(sum(g.cost for g in segs))
    for g in segs:  # each segment is priced at the rate of the time it falls in
        want = estimate_cost(s, g.start, (g.end - g.start).total_seconds(), 16)
        assert g.cost == pytest.approx(want.cost) and g.offpeak == (want.offpeak_gpu_hours > 0)
    # run-now rents once: the plan equals estimate_cost over provisioning + training
    once = plan_nights(
        s.model_copy(update={"policy": "run-now"}), at(2026, 6, 1, 4), night_inputs(steps=700, step=47.0)
    )
    assert once.total_nights == 1
    assert once.cost == pytest.approx(estimate_cost(s, at(2026, 6, 1, 4), 700 * 47.0, 8, provisioning_s=600).cost)


def test_without_a_step_time_the_plan_says_so_and_the_budget_is_not_claimed():
    s = sched("split", price_per_gpu_hour=1.0, budget=1.0)
    p = plan_nights(s, at(2026, 6, 1, 3), night_inputs(step=None))
    assert not p.complete and p.total_nights is None and p.finish is None and len(p.nights) == 1
    assert "no step-time prediction" in p.note and p.nights[0].end == at(2026, 6, 1, 6)
    check = refuse_if_over(s, p)  # not refused on a guess, but never "within budget"
    assert check.ok is None and "not checked" in check.message and "within" not in check.message
    once = plan_nights(sched("run-now", budget=1.0), at(2026, 6, 1, 3), night_inputs(step=None))
    assert "no step-time prediction" in once.note and budget_check(sched("run-now", budget=1.0), once).ok is None


def test_budget_and_max_nights_refuse_with_the_figures():
    s = sched("split", price_per_gpu_hour=1.0, offpeak_discount=0.5, budget=100.0, max_nights=2)
    inp = night_inputs(steps=600, step=60.0, gpus=1)
    with pytest.raises(TooManyNights, match=r"needs 3 nights .*max_nights is 2"):
        refuse_if_over(s, plan_nights(s, at(2026, 6, 1, 2), inp))
    # money spent in earlier nights counts against the budget
    cont = dataclasses.replace(inp, steps=10, resumed=True, nights_used=1, spent=99.9)
    with pytest.raises(BudgetExceeded, match=r"99.90 USD already spent"):
        refuse_if_over(s, plan_nights(s, at(2026, 6, 2, 2), cont))
    assert plan_nights(s, at(2026, 6, 2, 2), cont).nights[0].index == 2


def test_seed_case_prices_every_training_hour_offpeak():
    """Llama-2-70B on 8 × 4 A800, 02:00–06:00 Asia/Shanghai at −18%, split, 1.80 USD/GPU-hour (issue 20)."""
    from nightloom.planner import plan_for_spec
    from nightloom.spec import RunSpec

    spec = RunSpec.model_validate(
        {
            "name": "seed",
            "model": {"name": "llama2-70b"},
            "dataset": {"path": "data"},
            "cluster": {"provider": "slurm", "nodes": 8, "gpus_per_node": 4, "gpu_type": "a800-80gb"},
            "train": {"steps": 2000, "seq_len": 4096, "global_batch": 32},
            "schedule": {"policy": "split", "price_per_gpu_hour": 1.8, "offpeak_discount": 0.18},
        }
    )
    chosen = plan_for_spec(spec, require_fit=False).chosen
    inp = inputs_for_spec(spec, planner_step_s=chosen.step_time_s, planner_detail=chosen.layout())
    assert inp.provisioning_source.startswith("default") and inp.checkpoint_s > 60
    p = plan_nights(spec.schedule, at(2026, 12, 1, 2), inp)
    assert p.total_nights >= 2 and p.nights[0].ends_run is False and p.nights[-1].ends_run
    assert p.offpeak_gpu_hours == pytest.approx(p.gpu_hours)  # nothing at the peak price
    assert all(g.offpeak for n in p.nights for g in n.segments)
    assert p.cost == pytest.approx(p.gpu_hours * 1.8 * 0.82)
    assert sum(n.steps for n in p.nights) == 2000
    assert p.uncertainty > 0.2 * 0.25 * p.training_s / 3600 * 32 * 1.8  # the step-time error is stated


def test_inputs_from_the_ledger_and_a_continuation():
    from types import SimpleNamespace as NS

    from nightloom.ledger import NightRecord
    from nightloom.spec import RunSpec

    spec = RunSpec.model_validate(
        {
            "name": "x",
            "dataset": {"path": "d"},
            "cluster": {"name": "c1", "nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu"},
            "train": {"steps": 50, "seq_len": 16, "global_batch": 4},
            "schedule": {"provisioning_minutes": 0.5},
        }
    )
    base = inputs_for_spec(spec, planner_step_s=None)
    assert base.step_time_s is None and base.provisioning_s == 30 and base.provisioning_source.startswith("spec")
    night = NightRecord(night=1, start=at(2026, 6, 1, 2), end=at(2026, 6, 1, 6), steps=20, steps_done=20, cost=3.0)

    def row(**kw):
        d = dict(run_id="r1", spec_hash=spec.spec_hash(), cluster="c1", provider="local", world_size=2)
        return NS(**(d | dict(status="stopped", tokens_per_s=32.0, time_to_ready_s=4.0, nights=[night], cost=3.0) | kw))

    runs = [row(), row(run_id="other", spec_hash="zz", tokens_per_s=1.0)]
    inp = inputs_for_spec(spec, planner_step_s=None, runs=runs, run_id="r1")
    assert inp.step_time_s == pytest.approx(4 * 16 / 32.0) and inp.step_source.startswith("ledger")
    assert inp.provisioning_s == 4.0 and inp.provisioning_source.startswith("ledger")
    assert (inp.resumed, inp.steps, inp.steps_done, inp.nights_used, inp.spent) == (True, 30, 20, 1, 3.0)
    fresh = inputs_for_spec(spec, planner_step_s=None, runs=runs, run_id="new")
    assert not fresh.resumed and fresh.steps == 50 and fresh.step_time_s == pytest.approx(2.0)


def test_billing_spans_and_run_cost():
    s = sched(price_per_gpu_hour=2.0, offpeak_discount=0.5)
    span = BillingSpan.between(at(2026, 6, 1, 5), at(2026, 6, 1, 7), 4)
    assert span.seconds == 2 * H and span.shifted(-H).start == at(2026, 6, 1, 4)
    assert BillingSpan.between(at(2026, 6, 1, 7), at(2026, 6, 1, 5), 4).seconds == 0.0
    # 30 min provisioning on 8 GPUs from 04:30 (off-peak), then the span: 1 h off-peak + 1 h peak on 4 GPUs
    assert run_cost(s, at(2026, 6, 1, 4, 30), 0.5 * H, 8, [span]) == pytest.approx(8 * 0.5 + 4 * 1.0 + 4 * 2.0)
    assert lost_time_cost(s, at(2026, 6, 1, 12), 0.0, 8) == 0.0
    assert lost_time_cost(s, at(2026, 6, 1, 12), H, 8) == pytest.approx(16.0)


def test_cost_cli_prints_the_nights_and_refuses_too_many(tmp_path, capsys):
    import json

    from flows.cli import main

    spec = write_spec(tmp_path, policy="split", max_nights=2)
    args = ["cost", spec, "--hours", "10", "--provisioning-min", "10", "--at", "2026-06-01T02:00:00+08:00"]
    assert main([*args, "--json"]) == 1  # 10 h of training in 4 h nights needs 3 nights
    out = json.loads(capsys.readouterr().out)
    plan = out["plan"]
    assert plan["totals"]["nights"] == 3 and len(plan["nights"]) == 3
    assert plan["totals"]["finish"].startswith("2026-06-03T") and plan["totals"]["finish"].endswith("+08:00")
    assert plan["totals"]["offpeak_gpu_hours"] == pytest.approx(plan["totals"]["gpu_hours"])
    assert plan["totals"]["cost"] == pytest.approx(sum(n["cost"] for n in plan["nights"]))
    assert out["cost"]["cost"] == pytest.approx(plan["totals"]["cost"]) and "needs 3 nights" in out["over_budget"]
    assert out["decision"]["action"] == "run" and out["decision"]["deadline"].startswith(
        "2026-05-31T21:59"
    )  # 06:00 CST less the checkpoint
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "nights: 3; predicted finish: 2026-06-03" in captured.out and "┃ night" in captured.out
    assert "needs 3 nights" in captured.err and "max_nights is 2" in captured.err


def test_gate_deadline_counts_money_spent_by_earlier_nights():
    from nightloom.schedule.gate import gate_decision
    from nightloom.spec import RunSpec

    spec = RunSpec.model_validate(
        {
            "name": "g",
            "dataset": {"path": "d"},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu"},
            "schedule": {"policy": "split", "price_per_gpu_hour": 3600.0, "offpeak_discount": 0.0, "budget": 100.0},
        }
    )
    now, real = at(2026, 6, 1, 5), datetime(2026, 1, 1, tzinfo=UTC)  # an injected clock, mapped onto the real one
    fresh = night_inputs(steps=10_000, step=1.0, gpus=2, prov=0.0, ckpt=30.0)
    d = gate_decision(spec, plan_nights(spec.schedule, now, fresh), now, real)
    # budget 100 at 2/s is spent after 50 s, so the stop's 30 s checkpoint starts by 20 s; the window is later
    assert d.run_now and d.deadline_kind == "budget" and d.deadline_unix == pytest.approx(real.timestamp() + 20)
    cont = dataclasses.replace(fresh, resumed=True, nights_used=1, spent=90.0, steps_done=500)
    d = gate_decision(spec, plan_nights(spec.schedule, now, cont), now, real)
    # 10 left: spent after 5 s, less than the checkpoint: the deadline has passed, the trainer stops at once
    assert d.deadline_kind == "budget" and d.deadline_unix == pytest.approx(real.timestamp() + 5 - 30)
    assert (d.night, d.spent, d.steps_done, d.clock_offset_s) == (2, 90.0, 500, (now - real).total_seconds())
    rich = spec.model_copy(update={"schedule": spec.schedule.model_copy(update={"budget": None})})
    d = gate_decision(rich, plan_nights(rich.schedule, now, fresh), now, real)
    assert d.deadline_kind == "window" and d.deadline_unix == pytest.approx(real.timestamp() + 3600 - 30)
    later = gate_decision(rich, plan_nights(rich.schedule, at(2026, 6, 1, 7), fresh), at(2026, 6, 1, 7), real)
    assert not later.run_now and later.next_run_at == at(2026, 6, 2, 2).astimezone(UTC).isoformat()
    nopred = gate_decision(spec, plan_nights(spec.schedule, now, night_inputs(step=None)), now, real)
    assert nopred.predicted_cost is None and "not checked" in nopred.budget


def test_a_night_is_priced_on_the_gate_clock_and_compared_with_its_prediction():
    from nightloom.schedule.gate import gate_decision
    from nightloom.schedule.night_record import night_record
    from nightloom.spec import RunSpec
    from nightloom.train.job import TrainResult

    spec = RunSpec.model_validate(
        {
            "name": "n",
            "dataset": {"path": "d"},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu"},
            "schedule": {"policy": "split", "price_per_gpu_hour": 3600.0, "offpeak_discount": 0.5},
        }
    )
    now, real = at(2026, 6, 1, 5, 59), datetime(2026, 1, 1, 12, tzinfo=UTC)  # 60 s left on the gate's clock
    cont = night_inputs(steps=1000, step=1.0, gpus=2, prov=5.0, ckpt=1.0, resumed=True, nights_used=1, steps_done=40)
    d = gate_decision(spec, plan_nights(spec.schedule, now, cont), now, real)
    assert d.night == 2 and d.predicted_steps == 53  # 60 − 5 provisioning − 1 restore − 1 checkpoint
    # what the real clock saw: ready 5 s after the gate, trained to the deadline, 3 s more to stop
    spans = [BillingSpan.between(real + timedelta(seconds=5), real + timedelta(seconds=62), 2)]
    result = TrainResult(steps_done=93, total_steps=1040, stopped="deadline", final_loss=1.0, tokens=0, wall_s=57)
    d = d.model_copy(update={"deadline_kind": "window"})
    n = night_record(spec, d, real, 5.0, 2, spans, result)
    assert n.start == now and n.end == now + timedelta(seconds=62) and (n.steps, n.steps_done) == (53, 93)
    # 60 s off-peak (1/s for 2 ranks) + 2 s at the peak (2/s): priced on the gate's clock, not the real one
    assert n.cost == pytest.approx(60 * 1.0 + 2 * 2.0) and n.stopped == "window"
    assert n.predicted_cost == pytest.approx(60.0) and abs(n.cost - n.predicted_cost) <= n.uncertainty
