"""Off-peak window decisions with an injected clock, window cost, budgets, rent vs buy."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from nightloom.schedule import (
    BillingSpan,
    BudgetExceeded,
    ScheduleError,
    budget_deadline,
    check_budget,
    cost_of_spans,
    current_window,
    decide,
    estimate_cost,
    next_window,
    rent_vs_buy,
    windows_between,
)
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
    assert "file not found" in capsys.readouterr().err
    cpu = tmp_path / "cpu.yaml"
    # tiny's max_seq is 512: the planner now applies the trainer's seq_len rule too
    text = Path(spec).read_text().replace("h100-80gb", "cpu").replace("llama2-7b", "tiny")
    cpu.write_text(text.replace("seq_len: 4096", "seq_len: 128"))
    assert main(["cost", str(cpu)]) == 2
    assert "give --hours" in capsys.readouterr().err
    # without --hours the planner's predicted step time sets the duration
    assert main(["cost", write_spec(tmp_path), "--at", "2026-06-01T03:00:00+08:00"]) == 0
    assert "planner: " in capsys.readouterr().out
