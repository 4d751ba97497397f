"""The run-summary artifact's cells: nothing the Prefect UI's markdown would turn into a list bullet."""

from __future__ import annotations

import re

from nightloom.gates import Verdict
from nightloom.report import NOT_MEASURED, RunSummary, StageTime, summary_rows

LIST_MARKER = re.compile(r"^\s*([-*+]|\d+\.)(\s|$)")  # what markdown renders as a list item


def _summary(**kw) -> RunSummary:
    base = dict(run_id="r1", name="demo", status="completed", shards=4, shard_imbalance=0.01, layout="DP2")
    base.update(world_size=2, first_loss=5.5, last_loss=4.1, steps=12)
    return RunSummary(**(base | kw))


def test_missing_figures_read_not_measured_and_no_cell_is_a_list_item():
    verdicts = [Verdict(name="mfu_floor", passed=True, skipped=True, reason="no floor set")]
    rows = summary_rows(_summary(), verdicts, 1.5, 0.0, "USD", [StageTime(stage="train", seconds=3.0)])
    values = {r["field"]: r["value"] for r in rows}
    assert values["tokens/s"] == values["MFU"] == values["MFU planned"] == NOT_MEASURED
    assert not [r for r in rows if LIST_MARKER.match(r["value"])], rows


def test_measured_figures_are_formatted():
    s = _summary(tokens_per_s=12345.6, mfu=0.0412, mfu_predicted=0.05, peak_source="measured: CPU matmul")
    values = {r["field"]: r["value"] for r in summary_rows(s, [], 2.0, 1.25, "USD", [])}
    assert values["tokens/s"] == "12,346"
    assert values["MFU"] == "4.12% (measured: CPU matmul)" and values["MFU planned"] == "5.00%"
    assert values["cost"] == "1.25 USD"


def test_summary_collects_each_stage_figures():
    from nightloom.sharding.manifest import ShardManifest

    m = ShardManifest(
        num_shards=4,
        key="<text>",
        salt="s",
        imbalance=0.01,
        imbalance_before_rebalance=0.05,
        balanced=True,
        rows=10,
        tokens=100,
        bytes=1000,
        shards=[],
    )
    s = _summary(shards=0, shard_imbalance=None)
    s.add_shards(m)
    s.add_nights(2, 1, "2026-12-03T02:24:00+08:00")
    assert (s.shards, s.shard_imbalance, s.shards_balanced) == (4, 0.01, True)
    assert s.nights_text() == "2 used, 1 left; predicted finish 2026-12-03T02:24:00+08:00"
    assert s.not_run("deferred", "outside the window", "2026-12-01T02:00", []) is s and s.status == "deferred"
