"""The step reporter: every registered sink receives every step's record; the stdout line, metrics.jsonl row and
Prometheus values are the trainer's formats for a fixed record."""

from __future__ import annotations

import json

from nightloom.metrics import read_metrics
from nightloom.train.reporting import (
    MetricsFileSink,
    PromSink,
    StdoutSink,
    StepRecord,
    StepReporter,
    step_line,
)


def _record(step: int = 3, **kw) -> StepRecord:
    values = dict(
        step=step,
        total_steps=10,
        loss=2.345678,
        grad_norm=0.98765,
        lr=1.5e-3,
        tokens=4096,
        tokens_per_s=12345.6,
        label_tokens=2048,
        label_tokens_per_s=6172.8,
        flops=1.0e12,
        hardware_flops=1.3e12,
        step_time_s=0.3317,
        peak_mem_bytes=123456789.0,
        local_mem_bytes=100000000,
        mfu=0.4123,
        hfu=0.5012,
        time=1_700_000_000.5,
        attempt=1,
        gap=False,
        world_size=2,
        collective_latency_s=0.0012,
    )
    values.update(kw)
    return StepRecord(**values)


class _Collect:
    def __init__(self) -> None:
        self.seen: list[StepRecord] = []

    def emit(self, record: StepRecord) -> None:
        self.seen.append(record)


def test_a_registered_sink_receives_every_step_record_in_order():
    reporter = StepReporter()
    first, second = _Collect(), _Collect()
    reporter.add(first)
    reporter.add(second)
    records = [_record(step=i) for i in range(1, 6)]
    for r in records:
        reporter.emit(r)
    assert first.seen == records
    assert second.seen == records


def test_stdout_sink_prints_the_step_line(capsys):
    StdoutSink().emit(_record())
    assert capsys.readouterr().out == (
        "step 3/10 loss 2.3457 grad_norm 0.988 lr 1.50e-03 tok/s 12,346 (labels 6,173) step 332 ms mfu 41.2% "
        "mem 118 MiB\n"
    )
    line = step_line(_record(label_tokens=4096, label_tokens_per_s=12345.6))
    assert line == "step 3/10 loss 2.3457 grad_norm 0.988 lr 1.50e-03 tok/s 12,346 step 332 ms mfu 41.2% mem 118 MiB"


def test_metrics_file_sink_appends_the_step_metrics_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = MetricsFileSink(path)
    sink.emit(_record(step=1, expert_tokens=[3, 1], router_aux_loss=0.01))
    sink.emit(_record(step=2, eval_loss=2.0, eval_ppl=7.389, eval_tokens=512))
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[0]["peak_mem_bytes"] == 123456789 and isinstance(rows[0]["peak_mem_bytes"], int)
    assert rows[0]["expert_tokens"] == [3, 1] and rows[0]["expert_imbalance"] == 1.5
    assert "eval_loss" not in rows[0] and rows[1]["eval_tokens"] == 512
    assert list(rows[1])[:4] == ["step", "loss", "grad_norm", "lr"]
    assert [m.step for m in read_metrics(path)] == [1, 2]


def test_prom_sink_sets_the_rank_gauges_with_local_memory():
    calls = []

    class _Prom:
        def update(self, **values):
            calls.append(("update", values))

        def experts(self, tokens, aux):
            calls.append(("experts", tokens, aux))

    PromSink(_Prom()).emit(_record(expert_tokens=[2, 2], router_aux_loss=0.5))
    assert calls[0][1]["memory_bytes"] == 100000000
    assert calls[0][1]["step"] == 3 and calls[0][1]["eval_loss"] is None
    assert calls[1] == ("experts", [2, 2], 0.5)


def test_grpo_figures_reach_the_line_the_metrics_row_and_the_trackers(tmp_path):
    from nightloom.track.sink import step_values

    figures = {"reward": 0.5, "reward_std": 0.25, "completions/mean_length": 5.5, "rewards/digits/mean": 0.5}
    record = _record(preference=figures)
    assert step_line(record).endswith(" reward 0.500 std 0.250 len 5.5")
    MetricsFileSink(tmp_path / "m.jsonl").emit(record)
    (row,) = read_metrics(tmp_path / "m.jsonl")
    assert row.model_extra["rewards/digits/mean"] == 0.5
    assert step_values(record).values["completions/mean_length"] == 5.5


def test_the_figures_both_records_name_go_across_unchanged():
    """SAME_FIGURES are fields of the StepRecord and of metrics.jsonl's StepMetrics; a record's values reach its
    metrics row under those names, and XTuner's StepRecord built back from that row (track_feed) holds them."""
    import dataclasses

    from nightloom.finetune.track_feed import step_record
    from nightloom.metrics import StepMetrics
    from nightloom.train.reporting import SAME_FIGURES, step_metrics

    both = {f.name for f in dataclasses.fields(StepRecord)} & set(StepMetrics.model_fields)
    converted = {"peak_mem_bytes", "time", "world_size", "router_aux_loss", "expert_tokens"}  # set one by one
    assert set(SAME_FIGURES) == both - converted
    r = _record(step=7, eval_loss=1.25, eval_ppl=3.49, eval_tokens=321, gap=True, attempt=2)
    row = step_metrics(r)
    back = step_record(row, total_steps=10, world_size=4, now=0.0)
    for name in SAME_FIGURES:
        assert getattr(row, name) == getattr(r, name) == getattr(back, name), name
